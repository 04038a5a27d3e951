//! `Tokenizer::set_chat_template_from` (TRL's `chat_template_path`): a Jinja file, or a model
//! directory's template and EOS token; what cannot be taken is refused, naming it.
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

    // A directory whose special tokens this vocabulary lacks is refused, naming them.
    let json_path = other.join("tokenizer.json");
    let mut tj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let next = tok.vocab_size() + 7;
    tj["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": next, "content": "<|tool_call|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    std::fs::write(&json_path, tj.to_string()).unwrap();
    let e = tok.set_chat_template_from(&other).unwrap_err().to_string();
    assert!(
        e.contains("<|tool_call|>") && e.contains("not in this model's vocabulary"),
        "{e}"
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
