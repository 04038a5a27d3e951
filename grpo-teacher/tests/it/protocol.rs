//! The protocol on a tiny generated model: probe, guidance, student passes with the baseline
//! computed once per problem, templates and the documented errors.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use candle_core::{DType, Device};
use grpo_rewards::builtin::LanguageScorer;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::scoring::ModelScorer;
use grpo_teacher::{
    LocalModel, ResponseQuality, TeacherConfig, TeacherError, TeachingProtocol, TemplateKind,
    guidance_style,
};

fn model(dir: &Path, seed: u64) -> LocalModel {
    init_model_dir(dir, Preset::Tiny, Arch::Llama, seed).unwrap();
    LocalModel::load(dir, DType::F32, &Device::Cpu, true).unwrap()
}

#[test]
fn probe_guidance_and_student_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let student = model(&tmp.path().join("student"), 1);
    let teacher = model(&tmp.path().join("teacher"), 2);
    let cfg = TeacherConfig {
        max_student_tokens: 12,
        ..Default::default()
    };
    let tp = TeachingProtocol::new(cfg, student.clone())
        .unwrap()
        .with_teacher(teacher);

    // The probe.
    let d = tp.diagnostic_probe("What is 3 + 4?", 8).unwrap();
    assert!(d.probe_tokens <= 8 && d.probe_tokens > 0);
    assert!(d.confidence_score > 0.0 && d.confidence_score <= 1.0);
    // Without a reference answer, capability is the confidence.
    assert_eq!(d.capability_level, d.confidence_score);
    match d.response_quality {
        ResponseQuality::Empty => assert!(d.probe.is_empty()),
        ResponseQuality::Truncated => assert!(d.probe_tokens == 8 && !d.probe.is_empty()),
        ResponseQuality::Complete => assert!(!d.probe.is_empty()),
    }
    assert!(d.identified_gaps.len() <= grpo_teacher::protocol::MAX_GAPS);

    // With a reference answer: the student's per-token probability of it as its solution.
    let r = tp
        .diagnostic_probe_with_reference("What is 3 + 4?", Some("7"), 8)
        .unwrap();
    let user = tp
        .render(TemplateKind::Baseline, &[("question", "What is 3 + 4?")])
        .unwrap();
    let (text, _) = student.prompt(&user).unwrap();
    let scorer = ModelScorer::new(&student.model, student.tokenizer.clone());
    let nll = scorer
        .completion_nll(&format!("{text}<solution>"), "7")
        .unwrap()
        .unwrap();
    assert!((r.capability_level - (-nll).exp()).abs() < 1e-6);
    assert_eq!(r.probe, d.probe, "greedy probes are reproducible");

    // Guidance follows the capability's style (the prompt says which).
    let prompt = tp.teacher_prompt("What is 3 + 4?", &r).unwrap();
    assert!(prompt.contains(guidance_style(r.capability_level)));
    assert!(prompt.contains(&r.probe));
    let g = tp.generate_guidance("What is 3 + 4?", &r, 16).unwrap();
    assert!(!g.contains("<teaching>"));

    // Student passes: one baseline per distinct problem, cached across calls.
    let items = [("2 + 2?", "count"), ("2 + 2?", "add"), ("5 + 1?", "add")];
    let first = tp.student_passes(&items, 0).unwrap();
    assert_eq!(first.len(), 3);
    assert_eq!(tp.baseline_runs(), 2);
    assert_eq!(first[0].baseline, first[1].baseline);
    let again = tp.student_passes(&[("2 + 2?", "other")], 0).unwrap();
    assert_eq!(
        tp.baseline_runs(),
        2,
        "the baseline is computed once per problem"
    );
    assert_eq!(again[0].baseline, first[0].baseline);
    // The answer with teaching is the student's greedy answer to the rendered prompt.
    let user = tp
        .render(
            TemplateKind::WithTeaching,
            &[("question", "5 + 1?"), ("teaching", "add")],
        )
        .unwrap();
    let direct = student.answer(&[user], 12, 0.0, 0).unwrap();
    assert_eq!(first[2].with_teaching.response, direct[0].text);
    assert!(first[2].with_teaching.tokens <= 12);
}

#[test]
fn documented_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let student = model(&tmp.path().join("student"), 3);
    let tp = TeachingProtocol::new(TeacherConfig::default(), student).unwrap();
    assert!(matches!(
        tp.diagnostic_probe("", 10),
        Err(TeacherError::EmptyTask { .. })
    ));
    assert!(matches!(
        tp.diagnostic_probe("  ", 10),
        Err(TeacherError::EmptyTask { .. })
    ));
    let e = tp.diagnostic_probe("2+2?", 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "diagnostic_probe: max_tokens must be >= 1, got 0"
    );
    let d = tp.diagnostic_probe("2+2?", 1).unwrap();
    assert_eq!(d.probe_tokens, 1);
    let e = tp.generate_guidance("2+2?", &d, 9).unwrap_err();
    assert_eq!(
        e.to_string(),
        "generate_guidance: max_tokens must be >= 10, got 9"
    );
    assert!(matches!(
        tp.generate_guidance("", &d, 50),
        Err(TeacherError::EmptyTask { .. })
    ));
    // No teacher given.
    assert!(matches!(
        tp.generate_guidance("2+2?", &d, 50),
        Err(TeacherError::Missing(_))
    ));
}

#[test]
fn templates_are_checked_and_rendered() {
    let t = TeacherConfig::default().validate().unwrap();
    let s = t
        .render(
            TemplateKind::WithTeaching,
            &[("question", "2+2?"), ("teaching", "count up")],
        )
        .unwrap();
    assert!(s.starts_with("Question: 2+2?"));
    assert!(s.contains("count up") && s.contains("<solution></solution>"));
    let s = t
        .render(
            TemplateKind::Teacher,
            &[
                ("question", "q"),
                ("approach", "my plan"),
                ("capability", "0.10"),
                ("style", guidance_style(0.1)),
            ],
        )
        .unwrap();
    assert!(s.contains("my plan") && s.contains("step-by-step") && s.contains("0.10"));

    // A typo in a variable is refused, naming the key.
    let bad = TeacherConfig {
        student_with_teaching_template: "{{ question }} {{ teachng }}".into(),
        ..Default::default()
    };
    let e = bad.validate().unwrap_err().to_string();
    assert!(
        e.contains("teacher.student_with_teaching_template") && e.contains("teachng"),
        "{e}"
    );
    let bad = TeacherConfig {
        teacher_adaptive_template: "{% if %}".into(),
        ..Default::default()
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("teacher.teacher_adaptive_template")
    );
    let bad = TeacherConfig {
        max_probe_tokens: 0,
        ..Default::default()
    };
    assert_eq!(
        bad.validate().unwrap_err().to_string(),
        "invalid teacher config: `teacher.max_probe_tokens`: must be >= 1"
    );
    let bad = TeacherConfig {
        logging_prob: 1.5,
        ..Default::default()
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("logging_prob")
    );

    // Styles by capability.
    assert!(guidance_style(0.0).contains("step-by-step"));
    assert!(guidance_style(0.29).contains("step-by-step"));
    assert!(guidance_style(0.3).contains("hints"));
    assert!(guidance_style(0.69).contains("hints"));
    assert!(guidance_style(0.7).contains("minimal"));
    assert!(guidance_style(1.0).contains("minimal"));
}
