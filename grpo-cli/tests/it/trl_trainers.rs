//! SFT, DPO, KTO, ORPO, CPO (SimPO, AlphaPO) and reward models against TRL 1.16's SFTTrainer,
//! DPOTrainer, KTOTrainer, RewardTrainer and experimental ORPOTrainer and CPOTrainer themselves
//! (`scripts/gen_trainers_reference.py`, transformers 5.24, torch on the CPU): the same tiny
//! model (`bench-qwen2-micro`) and rows, one batch per step, AdamW at 1e-3 with gradients
//! clipped at 1; each of 3 steps' metrics equal within 1e-4 — the first from the same weights,
//! the next two after our updates and TRL's.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunOptions};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../grpo-rollout/tests/fixtures")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("trainers_reference.json")).unwrap(),
    )
    .unwrap()
}

/// Runs `algorithm` for 3 steps on `model` (a fixture) and `data` with TRL's settings of the
/// reference run.
fn run_on(model: &str, algorithm: &str, data: &str, extra: &str) -> Vec<grpo_trainer::Metrics> {
    run_on_with(model, algorithm, data, extra, "")
}

/// [`run_on`] with `model_extra` lines in the `[model]` section.
fn run_on_with(
    model: &str,
    algorithm: &str,
    data: &str,
    extra: &str,
    model_extra: &str,
) -> Vec<grpo_trainer::Metrics> {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"
algorithm = "{algorithm}"
output_dir = "{out}"
[model]
path = "{model}"
{model_extra}
[data]
path = ["{data}"]
[optim]
learning_rate = 1e-3
lr_scheduler_type = "constant"
max_grad_norm = 1.0
weight_decay = 0.0
adam_epsilon = 1e-8
[train]
max_steps = 3
prompts_per_step = 4
per_device_train_batch_size = 4
save_steps = 0
{extra}
"#,
        out = dir.path().join("run").display(),
        model = fixtures().join(model).display(),
        data = fixtures().join(data).display(),
    );
    let p = dir.path().join("run.toml");
    std::fs::write(&p, text).unwrap();
    let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
    trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks)
        .unwrap()
        .metrics
}

fn run(algorithm: &str, data: &str, extra: &str) -> Vec<grpo_trainer::Metrics> {
    run_on("bench-qwen2-micro", algorithm, data, extra)
}

fn compare(ours: &[grpo_trainer::Metrics], trl: &serde_json::Value, keys: &[&str]) {
    let trl = trl.as_array().unwrap();
    assert_eq!(ours.len(), trl.len());
    for (s, (m, t)) in ours.iter().zip(trl).enumerate() {
        for k in keys {
            let (a, b) = (m[*k], t[*k].as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                "step {}: {k}: ours {a}, TRL {b}",
                s + 1
            );
        }
    }
}

/// What TRL's SFTTrainer logs each step (its entropy and mean_token_accuracy are the means
/// over the loss tokens of each micro-batch).
const SFT_KEYS: &[&str] = &[
    "loss",
    "grad_norm",
    "num_tokens",
    "entropy",
    "mean_token_accuracy",
];

#[test]
fn three_sft_steps_match_trls_sft_trainer() {
    let ours = run("sft", "sft_rows.jsonl", "");
    compare(&ours, &reference()["sft"], SFT_KEYS);
}

/// Conversations (a `messages` column, found without naming it), rendered by the model's chat
/// template and trained on every token: TRL's default.
#[test]
fn three_sft_steps_on_conversations_match_trls_sft_trainer() {
    let ours = run("sft", "sft_chat.jsonl", "");
    compare(&ours, &reference()["sft_chat"], SFT_KEYS);
}

/// `assistant_only_loss` with a template whose `{% generation %}` blocks mark the assistant's
/// tokens (`chat_template_path`, a Jinja file), as TRL requires for it.
#[test]
fn three_assistant_only_sft_steps_match_trls_sft_trainer() {
    let path = fixtures().join("chatml_generation.jinja");
    let extra = "[sft]\nassistant_only_loss = true\n".to_string();
    let ours = run_on_with(
        "bench-qwen2-micro",
        "sft",
        "sft_chat.jsonl",
        &extra,
        &format!("chat_template_path = \"{}\"\n", path.display()),
    );
    compare(&ours, &reference()["sft_assistant_only"], SFT_KEYS);
}

#[test]
fn three_dpo_steps_match_trls_dpo_trainer() {
    let ours = run("dpo", "reward_pairs.jsonl", "[dpo]\nbeta = 0.1\n");
    let mut keys = DPO_KEYS.to_vec();
    // DPOTrainer's token metrics: entropy over both sides' tokens, each side's mean logit,
    // the top-1 accuracy on the chosen tokens.
    keys.extend([
        "entropy",
        "logits/chosen",
        "logits/rejected",
        "mean_token_accuracy",
    ]);
    compare(&ours, &reference()["dpo"], &keys);
}

/// KTO in TRL's default order (`train_sampling_strategy = "sequential"`: each row's KL
/// completion is the completion of the row before it), which is ours for KTO too
/// (`train.shuffle_dataset` absent).
#[test]
fn three_kto_steps_match_trls_kto_trainer() {
    let ours = run("kto", "kto_rows.jsonl", "[kto]\nbeta = 0.1\n");
    compare(
        &ours,
        &reference()["kto"],
        &[
            "loss",
            "grad_norm",
            "kl",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
            "entropy",
            "logits/chosen",
            "logits/rejected",
        ],
    );
}

/// Reward modelling on transformers' tiny Qwen2ForSequenceClassification (`tiny-qwen2-rm`),
/// the pairs with margins: loss, accuracy, margin, reward range, token count, gradient norm.
#[test]
fn three_reward_model_steps_match_trls_reward_trainer() {
    let ours = run_on("tiny-qwen2-rm", "reward", "reward_pairs.jsonl", "");
    compare(
        &ours,
        &reference()["reward"],
        &[
            "loss",
            "accuracy",
            "margin",
            "min_reward",
            "mean_reward",
            "max_reward",
            "num_tokens",
            "grad_norm",
        ],
    );
}

/// DPO's metrics (and TPO's, whose NLL TRL folds into the loss).
const DPO_KEYS: &[&str] = &[
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
];

/// ORPO's and CPO's: DPO's and the NLL term.
fn pair_keys() -> Vec<&'static str> {
    let mut k = DPO_KEYS.to_vec();
    k.push("nll_loss");
    k
}

/// ORPO's: CPO's and the odds metrics.
fn orpo_keys() -> Vec<&'static str> {
    let mut k = pair_keys();
    k.extend(["log_odds_ratio", "log_odds_chosen"]);
    k
}

/// ORPO (TRL's experimental ORPOTrainer): no reference model; the NLL over the chosen
/// sequences' prompt and completion, the odds ratio on token-averaged log-probs.
#[test]
fn three_orpo_steps_match_trls_orpo_trainer() {
    let ours = run("orpo", "reward_pairs.jsonl", "[orpo]\nbeta = 0.1\n");
    compare(&ours, &reference()["orpo"], &orpo_keys());
}

/// ORPO on conversations (a system turn in one prompt): the chat template renders the prompt
/// with the generation prompt, each completion is the rest of prompt + completion.
#[test]
fn three_orpo_steps_on_conversations_match_trls_orpo_trainer() {
    let ours = run("orpo", "pairs_chat.jsonl", "[orpo]\nbeta = 0.25\n");
    compare(&ours, &reference()["orpo_chat"], &orpo_keys());
}

/// CPO's default sigmoid loss on summed log-probs with the behaviour-cloning term.
#[test]
fn three_cpo_steps_match_trls_cpo_trainer() {
    let ours = run("cpo", "reward_pairs.jsonl", "[cpo]\nbeta = 0.1\n");
    compare(&ours, &reference()["cpo"], &pair_keys());
}

/// SimPO (CPO's `simpo` loss type: token-averaged log-probs, target margin γ) with a
/// behaviour-cloning term, and AlphaPO (`alphapo`: simpo without it, AlphaPO's reward shape).
#[test]
fn three_simpo_and_alphapo_steps_match_trls_cpo_trainer() {
    let simpo = "[cpo]\nloss_type = \"simpo\"\nbeta = 2.0\nsimpo_gamma = 0.5\ncpo_alpha = 0.5\n";
    let ours = run("cpo", "reward_pairs.jsonl", simpo);
    compare(&ours, &reference()["cpo_simpo"], &pair_keys());
    let alphapo = "[cpo]\nloss_type = \"alphapo\"\nbeta = 2.5\nalpha = 0.25\n";
    let ours = run("cpo", "reward_pairs.jsonl", alphapo);
    compare(&ours, &reference()["cpo_alphapo"], &pair_keys());
}

/// TRL's `tokenize_row` details: a prompt whose last token merges into the chosen completion
/// (the chosen side's prompt one token shorter than the rejected side's), BOS put before every
/// prompt (the tokenizer given `<|im_start|>` as its BOS token), EOS after every completion
/// unless the text ends with it, and completions cut at `max_length` after their prompt.
#[test]
fn three_orpo_steps_with_bos_merges_and_truncation_match_trls_orpo_trainer() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("bos-model");
    std::fs::create_dir(&model).unwrap();
    for e in std::fs::read_dir(fixtures().join("bench-qwen2-micro")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
    }
    let cfg_path = model.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["bos_token"] = "<|im_start|>".into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let ours = run_on(
        model.to_str().unwrap(),
        "orpo",
        "pairs_merge.jsonl",
        "[orpo]\nbeta = 0.1\nmax_length = 14\n",
    );
    compare(&ours, &reference()["orpo_bos_merge"], &orpo_keys());
}

/// TPO (TRL's experimental TPOTrainer): DPO's tokenisation with a third, gold completion whose
/// NLL joins the contrastive loss; the sigmoid loss, and TPO-L with label smoothing and a
/// halved NLL weight.
#[test]
fn three_tpo_steps_match_trls_tpo_trainer() {
    let ours = run("tpo", "triples.jsonl", "[tpo]\nbeta = 0.1\n");
    compare(&ours, &reference()["tpo"], DPO_KEYS);
    let tpo_l = "[tpo]\nloss_type = \"tpo-l\"\nbeta = 2.0\ntpo_l_gamma = 0.5\ntpo_alpha = 0.5\n\
                 label_smoothing = 0.1\n";
    let ours = run("tpo", "triples.jsonl", tpo_l);
    compare(&ours, &reference()["tpo_l"], DPO_KEYS);
}
