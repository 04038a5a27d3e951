//! `grpo_rollout::remote::parse_completions`: how a server's `/v1/completions` answer becomes
//! completions — vLLM's token-id extensions, the re-tokenised fallback of a plain OpenAI server,
//! finish reasons, and malformed answers. (The client against a live server is tested in
//! `tests/tests/it/rollout_openai.rs`.)
#![allow(clippy::unwrap_used, missing_docs)]

use grpo_rollout::generate::{FinishReason, SamplingParams};
use grpo_rollout::init::train_tokenizer;
use grpo_rollout::remote::{RemoteConfig, RemoteGenerator, parse_completions};
use serde_json::json;

#[test]
fn token_ids_come_from_vllm_extensions_or_the_text() {
    let tok = train_tokenizer(400).unwrap();
    let eos = tok.eos_token_ids[0];
    let hello = tok.encode("hello world", false).unwrap();
    let p = SamplingParams {
        stop: vec!["\n".into()],
        ..Default::default()
    };
    let resp = json!({"choices": [
        // return_token_ids: `token_ids` wins, with the log-probs of the sampled tokens.
        {"index": 0, "text": "x", "token_ids": [5, 6, eos], "finish_reason": "stop",
         "logprobs": {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -1.0, -0.25]}},
        // return_tokens_as_token_ids only.
        {"index": 1, "text": "y", "finish_reason": "length",
         "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-2.0, -3.0]}},
        // A plain OpenAI server: the text is re-tokenised; the log-probs count matches, kept.
        {"index": 2, "text": "hello world", "finish_reason": "stop",
         "logprobs": {"tokens": ["hello", " world"], "token_logprobs": vec![-1.0; hello.len()]}},
        // ... and when it does not match, they are dropped (the learner treats it as on-policy).
        {"index": 3, "text": "hello world", "finish_reason": "stop",
         "logprobs": {"token_logprobs": vec![-1.0; hello.len() + 1]}},
    ]});
    let c = parse_completions(&resp, &tok, 2, 2, &p).unwrap();
    assert_eq!((c[0].prompt_index, c[0].sample_index), (0, 0));
    assert_eq!((c[3].prompt_index, c[3].sample_index), (1, 1));
    assert_eq!(c[0].token_ids, vec![5, 6, eos]);
    assert_eq!(c[0].logprobs, vec![-0.5, -1.0, -0.25]);
    assert_eq!(c[0].finish_reason, FinishReason::Eos);
    assert_eq!(c[1].token_ids, vec![7, 8]);
    assert_eq!(c[1].finish_reason, FinishReason::Length);
    assert_eq!(c[2].token_ids, hello);
    assert_eq!(c[2].logprobs.len(), hello.len());
    assert_eq!(c[2].finish_reason, FinishReason::Stop); // no EOS id at the end, a stop string set
    assert!(c[3].logprobs.is_empty());
}

#[test]
fn malformed_answers_are_errors() {
    let tok = train_tokenizer(400).unwrap();
    let p = SamplingParams::default();
    let e = parse_completions(&json!({"error": "x"}), &tok, 1, 1, &p).unwrap_err();
    assert!(e.to_string().contains("no `choices`"), "{e}");
    let e = parse_completions(&json!({"choices": [{"text": "a"}]}), &tok, 1, 2, &p).unwrap_err();
    assert!(
        e.to_string()
            .contains("1 choices, expected 1 prompts × n = 2"),
        "{e}"
    );
    let e = parse_completions(
        &json!({"choices": [{"index": 0, "token_ids": ["a"]}]}),
        &tok,
        1,
        1,
        &p,
    )
    .unwrap_err();
    assert!(e.to_string().contains("non-integer"), "{e}");
}

#[test]
fn bad_urls_and_absent_servers_fail_fast() {
    let e = RemoteGenerator::connect(RemoteConfig {
        base_url: "localhost:8000".into(),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("expected http://"), "{e}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = RemoteGenerator::connect(RemoteConfig {
        base_url: format!("http://127.0.0.1:{port}/v1"),
        max_retries: 0,
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("is the server running?"), "{e}");
    let e = RemoteGenerator::connect(RemoteConfig {
        api_key: "key\n".into(),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("api_key"), "{e}");
}
