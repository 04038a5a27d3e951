//! `Tokenizer::set_chat_template_from` (TRL's `chat_template_path`): a Jinja file, or a model
//! directory's template and EOS token, its missing tokens added as TRL's `clone_chat_template`
//! adds them (checked against transformers); what cannot be taken is refused, naming it.
#![allow(clippy::unwrap_used, missing_docs)]

use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::{Arch, ChatMessage, Tokenizer};

fn msgs() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "hi there"),
        ChatMessage::new("assistant", "hello"),
    ]
}

#[test]
fn a_jinja_file_or_a_directory_replaces_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    init_model_dir(&model, Preset::Tiny, Arch::Qwen2, 1).unwrap();
    let mut tok = Tokenizer::from_hf_dir(&model, &[]).unwrap();
    let own = tok.apply_chat_template(&msgs(), true).unwrap();

    // A Jinja file: only the template changes.
    let jinja = dir.path().join("plain.jinja");
    std::fs::write(
        &jinja,
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}",
    )
    .unwrap();
    let eos = tok.eos_token_ids.clone();
    tok.set_chat_template_from(&jinja).unwrap();
    let text = tok.apply_chat_template(&msgs(), true).unwrap();
    assert_eq!(text, "[user] hi there\n[assistant] hello\n[assistant] ");
    assert_eq!(tok.eos_token_ids, eos);

    // A directory: its template and its EOS token (here <|endoftext|> instead of <|im_end|>).
    let other = dir.path().join("other");
    init_model_dir(&other, Preset::Tiny, Arch::Qwen2, 2).unwrap();
    let cfg_path = other.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["eos_token"] = "<|endoftext|>".into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    tok.set_chat_template_from(&other).unwrap();
    assert_eq!(tok.apply_chat_template(&msgs(), true).unwrap(), own);
    assert_eq!(tok.eos_token.as_deref(), Some("<|endoftext|>"));
    assert_eq!(
        tok.eos_token_ids,
        vec![tok.inner.token_to_id("<|endoftext|>").unwrap()]
    );

    // A file that is not a template, and a path that does not exist.
    let bad = dir.path().join("bad.jinja");
    std::fs::write(&bad, "{% for m in messages %}").unwrap();
    let e = tok.set_chat_template_from(&bad).unwrap_err().to_string();
    assert!(
        e.contains("bad.jinja") && e.contains("chat template"),
        "{e}"
    );
    let e = tok
        .set_chat_template_from(&dir.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nowhere"), "{e}");
}

/// transformers' `{% generation %}` blocks (TRL's training templates): the template renders
/// as without them, whitespace control included, and the blocks' output is reported as byte
/// ranges — what `return_assistant_tokens_mask` marks.
#[test]
fn generation_blocks_render_and_mark_the_assistant_text() {
    use grpo_rollout::tokenizer::ChatTemplate;
    let plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{{ m.content }}<|im_end|>\n{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}";
    let tagged = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}\n  {%- generation -%}\n{{ m.content }}<|im_end|>\n  {%- endgeneration %}\n\n{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}";
    let msgs = vec![
        ChatMessage::new("user", "hi"),
        ChatMessage::new("assistant", "hello"),
        ChatMessage::new("user", "bye"),
        ChatMessage::new("assistant", "see you"),
    ];
    let a = ChatTemplate::new(plain, None, None).unwrap();
    let b = ChatTemplate::new(tagged, None, None).unwrap();
    assert!(!a.tracks_generation() && b.tracks_generation());
    let (text, spans) = b.render_tracked(&msgs, false).unwrap();
    assert_eq!(text, a.render(&msgs, false).unwrap());
    assert_eq!(
        b.render(&msgs, false).unwrap(),
        text,
        "no marker left in a plain rendering"
    );
    let marked: Vec<&str> = spans.iter().map(|r| &text[r.clone()]).collect();
    // `{%- endgeneration %}` trims the newline inside; the one after it is outside.
    assert_eq!(marked, vec!["hello<|im_end|>", "see you<|im_end|>"]);
    assert!(a.render_tracked(&msgs, false).unwrap().1.is_empty());
}

/// TRL's `clone_chat_template` on bench-qwen2-micro's tokenizer with the `clone-source`
/// directory (its template ends turns with `<|eot|>`, which the target lacks, and it adds
/// `<think>`, `</think>`, `<|tool_call|>`): the same added ids and flags, EOS, `<extra_id_N>`
/// fillers up to a multiple of 64, and the same tokens for a rendered conversation as
/// transformers (`scripts/gen_clone_chat_template_reference.py`); the embeddings grow with
/// rows at the mean of the old ones.
#[test]
fn a_directory_with_missing_tokens_is_cloned_as_trl_clones_it() {
    use candle_core::{DType, Device};
    let fix = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fix.join("clone_chat_template_reference.json")).unwrap(),
    )
    .unwrap();
    let mut loaded =
        grpo_rollout::load(&fix.join("bench-qwen2-micro"), DType::F32, &Device::Cpu).unwrap();
    let tok = &mut loaded.tokenizer;
    let added = tok
        .set_chat_template_from(&fix.join("clone-source"))
        .unwrap();
    let n = tok.vocab_size().div_ceil(64) * 64;
    assert_eq!(n, r["embedding_rows"].as_u64().unwrap() as usize);
    let fillers = tok.pad_vocab_to(n);
    let all: Vec<u64> = added
        .iter()
        .chain(&fillers)
        .map(|&i| u64::from(i))
        .collect();
    let want: Vec<u64> = serde_json::from_value(r["added_ids"].clone()).unwrap();
    assert_eq!(all, want);
    let contents: Vec<String> = all
        .iter()
        .map(|&i| tok.inner.id_to_token(i as u32).unwrap())
        .collect();
    let want: Vec<String> = serde_json::from_value(r["added_contents"].clone()).unwrap();
    assert_eq!(contents, want);
    let decoder = tok.inner.get_added_tokens_decoder();
    for (content, special) in r["special"].as_object().unwrap() {
        let t = decoder.values().find(|t| &t.content == content).unwrap();
        assert_eq!(t.special, special.as_bool().unwrap(), "{content}");
    }
    assert_eq!(tok.vocab_size(), r["vocab_size"].as_u64().unwrap() as usize);
    assert_eq!(tok.eos_token.as_deref(), r["eos_token"].as_str());
    assert_eq!(
        tok.eos_token_ids,
        vec![r["eos_token_id"].as_u64().unwrap() as u32]
    );
    let msgs = vec![
        ChatMessage::new("user", "hi <|tool_call|> there"),
        ChatMessage::new("assistant", "hello"),
    ];
    let text = tok.apply_chat_template(&msgs, false).unwrap();
    assert_eq!(text, r["text"].as_str().unwrap());
    let ids: Vec<u64> = tok
        .encode(&text, false)
        .unwrap()
        .into_iter()
        .map(u64::from)
        .collect();
    let want: Vec<u64> = serde_json::from_value(r["ids"].clone()).unwrap();
    assert_eq!(ids, want);
    let idv: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    assert_eq!(
        tok.decode(&idv, true).unwrap(),
        r["decoded_skip_special"].as_str().unwrap()
    );

    // The model half: rows past the old 300 at the mean of the old rows, the old rows kept.
    let m = &mut loaded.model;
    let old = m.embed_tokens.clone();
    m.resize_token_embeddings(n).unwrap();
    assert_eq!((m.cfg.vocab_size, m.embed_tokens.dims()[0]), (n, n));
    let kept = m.embed_tokens.narrow(0, 0, 300).unwrap();
    let diff = |a: &candle_core::Tensor, b: &candle_core::Tensor| {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    assert_eq!(diff(&kept, &old), 0.0);
    let mean = old.mean_keepdim(0).unwrap();
    for row in 300..n {
        assert!(diff(&m.embed_tokens.narrow(0, row, 1).unwrap(), &mean) < 1e-7);
    }
    // The resized model runs over the new ids; shrinking drops the last rows.
    let x = candle_core::Tensor::new(&[[1u32, 303, 319]], &Device::Cpu).unwrap();
    let mask = candle_core::Tensor::ones((1, 3), DType::U32, &Device::Cpu).unwrap();
    let h = m.forward_padded(&x, &mask).unwrap();
    assert_eq!(h.dims(), [1, 3, m.cfg.hidden_size]);
    m.resize_token_embeddings(200).unwrap();
    assert_eq!(diff(&m.embed_tokens, &old.narrow(0, 0, 200).unwrap()), 0.0);
}
