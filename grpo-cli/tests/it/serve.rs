//! `grpo-cli serve` on loopback: answers equal local generation (tokens, log-probs, top
//! log-probs), concurrent requests are batched without changing any answer, LoRA adapters load,
//! serve and unload as vLLM's endpoints define, bad requests are 4xx naming the field (on one
//! line, even with `RUST_BACKTRACE=1`), unsupported fields are refused, `logit_bias` forces and
//! bans tokens, streamed answers (read with an SSE client) add up to the answers not streamed,
//! `echo` scores the prompt as the model does locally (lm-evaluation-harness's log-likelihood
//! request), and a full queue answers 429 while the server keeps serving.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::BufRead;
use std::path::Path;

use candle_core::{DType, Device};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use grpo_cli::serve::{ServeOptions, Server, start};
use grpo_rollout::generate::{SamplingParams, generate};
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::{Arch, ChatMessage, LoadedModel};
use serde_json::{Value, json};

fn model(dir: &Path) -> LoadedModel {
    if !dir.join("config.json").exists() {
        init_model_dir(dir, Preset::Tiny, Arch::Qwen2, 21).unwrap();
    }
    grpo_rollout::load(dir, DType::F32, &Device::Cpu).unwrap()
}

fn server(dir: &Path, f: impl FnOnce(&mut ServeOptions)) -> Server {
    let mut o = ServeOptions::new(dir);
    o.served_model_name = "tiny".into();
    o.addr = "127.0.0.1:0".parse().unwrap();
    f(&mut o);
    start(o).unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn post(url: &str, body: Value) -> (u16, Value, Option<String>) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
        retry,
    )
}

/// A streamed request read as server-sent events, one at a time as they arrive: the status,
/// the content type and each event's data (`[DONE]` as it is). With `stats`, the server's
/// `/stats` is read once the first event has arrived.
async fn stream(url: &str, body: Value, stats: Option<&str>) -> (u16, String, Vec<String>, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let kind = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let mut events = r.bytes_stream().eventsource();
    let mut data = Vec::new();
    let mut seen = Value::Null;
    while let Some(e) = events.next().await {
        data.push(e.unwrap().data);
        if let Some(url) = stats
            && data.len() == 1
        {
            seen = reqwest::get(url).await.unwrap().json().await.unwrap();
        }
    }
    (status, kind, data, seen)
}

/// The chunks of a stream (every event before `[DONE]`, which must end it).
fn chunks(events: &[String]) -> Vec<Value> {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

fn get_json(rt: &tokio::runtime::Runtime, url: &str) -> Value {
    rt.block_on(async { reqwest::get(url).await.unwrap().json().await.unwrap() })
}

/// Greedy local generation: what the server must answer at temperature 0.
fn greedy_local(
    m: &grpo_rollout::Transformer,
    tok: &grpo_rollout::Tokenizer,
    ids: &[u32],
    k: usize,
) -> grpo_rollout::Completion {
    let p = SamplingParams {
        max_new_tokens: k,
        temperature: 0.0,
        ..Default::default()
    };
    generate(&m.detached(), tok, &[ids.to_vec()], 1, &p)
        .unwrap()
        .remove(0)
}

fn ids_of(tokens: &Value) -> Vec<u32> {
    tokens
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            t.as_str()
                .unwrap()
                .strip_prefix("token_id:")
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn completions_equal_local_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let prompt: Vec<u32> = m.tokenizer.encode("What is 2 + 3?", false).unwrap();
    let rt = rt();
    let (st, body, _) = rt.block_on(post(
        &url,
        json!({"model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 8, "temperature": 0.9,
               "top_p": 0.95, "seed": 5, "logprobs": 2, "return_tokens_as_token_ids": true}),
    ));
    assert_eq!(st, 200, "{body}");
    let local = generate(
        &m.model.detached(),
        &m.tokenizer,
        std::slice::from_ref(&prompt),
        3,
        &SamplingParams {
            max_new_tokens: 8,
            temperature: 0.9,
            top_p: 0.95,
            seed: 5,
            top_logprobs: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut completion_tokens = 0;
    for (c, l) in choices.iter().zip(&local) {
        let lp = &c["logprobs"];
        assert_eq!(ids_of(&lp["tokens"]), l.token_ids);
        assert_eq!(c["text"], l.text);
        let got = f32s(&lp["token_logprobs"]);
        assert_eq!(got.len(), l.logprobs.len());
        for (a, b) in got.iter().zip(&l.logprobs) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // top_logprobs: the sampled token plus the 2 best alternatives.
        for (k, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
            let top = top.as_object().unwrap();
            assert!(top.contains_key(&format!("token_id:{}", l.token_ids[k])));
            for (id, alp) in &l.top_logprobs[k] {
                let v = top[&format!("token_id:{id}")].as_f64().unwrap() as f32;
                assert!((v - alp).abs() < 1e-5);
            }
        }
        let reason = if l.finish_reason == grpo_rollout::FinishReason::Length {
            "length"
        } else {
            "stop"
        };
        assert_eq!(c["finish_reason"], reason);
        completion_tokens += l.token_ids.len();
    }
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(body["usage"]["completion_tokens"], completion_tokens);
    assert_eq!(body["object"], "text_completion");

    // A text prompt is tokenised with the tokenizer's special tokens; several prompts give
    // prompt-major choices; return_token_ids adds the ids.
    let (st, body, _) = rt.block_on(post(
        &url,
        json!({"prompt": ["alpha beta", "gamma"], "n": 2, "max_tokens": 4, "temperature": 0,
               "return_token_ids": true}),
    ));
    assert_eq!(st, 200, "{body}");
    let ch = body["choices"].as_array().unwrap();
    assert_eq!(ch.len(), 4);
    assert!(ch[0]["logprobs"].is_null());
    let p1 = m.tokenizer.encode("gamma", true).unwrap();
    assert_eq!(ch[2]["prompt_token_ids"], json!(p1));
    let greedy = greedy_local(&m.model, &m.tokenizer, &p1, 4);
    assert_eq!(ch[3]["token_ids"], json!(greedy.token_ids));

    // /v1/models and /health.
    let health = rt.block_on(async {
        reqwest::get(format!("http://{}/health", srv.addr))
            .await
            .unwrap()
            .status()
    });
    assert_eq!(health.as_u16(), 200);
    let models: Value = get_json(&rt, &format!("{}/models", srv.base_url()));
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(
        models["data"][0]["max_model_len"],
        m.model.cfg.max_position_embeddings
    );
}

#[test]
fn concurrent_requests_are_batched_and_each_answer_is_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let texts = [
        "one two",
        "three",
        "four five six",
        "seven",
        "eight nine",
        "ten",
        "a b c",
        "d",
    ];
    let rt = rt();
    let answers: Vec<(u16, Value, Option<String>)> = rt.block_on(async {
        let tasks: Vec<_> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let url = url.clone();
                let body = json!({"prompt": t, "n": 2, "max_tokens": 12, "seed": i, "logprobs": 0,
                                  "return_tokens_as_token_ids": true});
                tokio::spawn(async move { post(&url, body).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let detached = m.model.detached();
    for (i, (st, body, _)) in answers.iter().enumerate() {
        assert_eq!(*st, 200, "{body}");
        let ids = m.tokenizer.encode(texts[i], true).unwrap();
        let alone = generate(
            &detached,
            &m.tokenizer,
            &[ids],
            2,
            &SamplingParams {
                max_new_tokens: 12,
                seed: i as u64,
                ..Default::default()
            },
        )
        .unwrap();
        for (c, l) in body["choices"].as_array().unwrap().iter().zip(&alone) {
            assert_eq!(ids_of(&c["logprobs"]["tokens"]), l.token_ids, "request {i}");
        }
    }
    let stats: Value = get_json(&rt, &format!("http://{}/stats", srv.addr));
    assert_eq!(stats["requests"], 8);
    assert!(stats["batches"].as_u64().unwrap() < 8, "{stats}");
}

#[test]
fn chat_completions_render_the_template() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let rt = rt();
    let (st, body, _) = rt.block_on(post(
        &format!("{}/chat/completions", srv.base_url()),
        json!({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
               "max_completion_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 3}),
    ));
    assert_eq!(st, 200, "{body}");
    let text = m
        .tokenizer
        .apply_chat_template(&[ChatMessage::new("user", "Hi there")], true)
        .unwrap();
    let ids = m.tokenizer.encode(&text, false).unwrap();
    let local = [greedy_local(&m.model, &m.tokenizer, &ids, 6)];
    let c = &body["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["content"], local[0].text);
    let content = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), local[0].token_ids.len());
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    assert_eq!(body["object"], "chat.completion");
}

#[test]
fn lora_adapters_load_serve_and_unload() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    // An adapter whose B is not zero, so it changes the model.
    let cfg = grpo_rollout::LoraConfig {
        r: 4,
        lora_alpha: 16.0,
        ..Default::default()
    };
    let mut adapted = m.model.clone();
    let factors = grpo_rollout::lora::attach(&mut adapted, &cfg, 3).unwrap();
    let filled: std::collections::HashMap<String, candle_core::Tensor> = factors
        .into_iter()
        .map(|(k, t)| {
            let t = if k.contains("lora_B") {
                t.randn_like(0.0, 0.3).unwrap()
            } else {
                t
            };
            (k, t)
        })
        .collect();
    grpo_rollout::lora::set_factors(&mut adapted, &cfg, &filled).unwrap();
    let dir = tmp.path().join("adapter");
    grpo_rollout::lora::save_peft(&adapted, &cfg, &dir, "tiny").unwrap();

    let srv = server(&tmp.path().join("m"), |_| {});
    let base = srv.base_url();
    let rt = rt();
    let prompt: Vec<u32> = m.tokenizer.encode("seven eight", false).unwrap();
    let greedy = |model: &str| json!({"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": true});
    let (st, body, _) = rt.block_on(post(
        &format!("{base}/load_lora_adapter"),
        json!({"lora_name": "policy", "lora_path": dir.display().to_string()}),
    ));
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        body,
        json!("Success: LoRA adapter 'policy' added successfully.")
    );
    let models: Value = get_json(&rt, &format!("{base}/models"));
    assert_eq!(models["data"][1]["id"], "policy");
    assert_eq!(models["data"][1]["parent"], "tiny");

    let mut local = m.model.clone();
    grpo_rollout::lora::load_peft(&mut local, &dir).unwrap();
    let want = greedy_local(&local, &m.tokenizer, &prompt, 10);
    let (st, with, _) = rt.block_on(post(&format!("{base}/completions"), greedy("policy")));
    assert_eq!(st, 200, "{with}");
    assert_eq!(with["choices"][0]["token_ids"], json!(want.token_ids));
    let (_, plain, _) = rt.block_on(post(&format!("{base}/completions"), greedy("tiny")));
    assert_ne!(
        plain["choices"][0]["token_ids"],
        with["choices"][0]["token_ids"]
    );

    // vLLM's rules: a second load of a name is refused unless in place; bad paths are 400;
    // unloading twice is 404; an unloaded adapter is an unknown model.
    let load = |name: &str, path: String, inplace: bool| {
        rt.block_on(post(
            &format!("{base}/load_lora_adapter"),
            json!({"lora_name": name, "lora_path": path, "load_inplace": inplace}),
        ))
    };
    let (st, body, _) = load("policy", dir.display().to_string(), false);
    assert_eq!(st, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("already been loaded")
    );
    assert_eq!(load("policy", dir.display().to_string(), true).0, 200);
    let (st, body, _) = load("other", "/nonexistent/adapter".into(), false);
    assert_eq!(st, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/adapter"),
        "{body}"
    );
    let unload = || {
        rt.block_on(post(
            &format!("{base}/unload_lora_adapter"),
            json!({"lora_name": "policy"}),
        ))
    };
    let (st, body, _) = unload();
    assert_eq!(
        (st, body),
        (
            200,
            json!("Success: LoRA adapter 'policy' removed successfully.")
        )
    );
    assert_eq!(unload().0, 404);
    let (st, body, _) = rt.block_on(post(&format!("{base}/completions"), greedy("policy")));
    assert_eq!(st, 404);
    assert_eq!(body["error"]["param"], "model");
}

#[test]
fn bad_requests_are_4xx_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |o| o.max_model_len = Some(64));
    let url = format!("{}/completions", srv.base_url());
    let rt = rt();
    let cases = [
        (
            json!({"prompt": "hi", "temperature": -1}),
            400,
            "temperature",
        ),
        (json!({"prompt": "hi", "top_p": 0}), 400, "top_p"),
        (json!({"prompt": "hi", "n": 0}), 400, "n"),
        (
            json!({"prompt": "hi", "stream_options": {"include_usage": true}}),
            400,
            "stream_options",
        ),
        (
            json!({"prompt": "hi", "stream": true, "stream_options": {"include_usage": 1}}),
            400,
            "stream_options",
        ),
        // Fields that would change the answer and are not implemented are refused, by name.
        (
            json!({"prompt": "hi", "response_format": {"type": "json_object"}}),
            400,
            "response_format",
        ),
        (
            json!({"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            400,
            "tools",
        ),
        (json!({"prompt": "hi", "suffix": "!"}), 400, "suffix"),
        (
            json!({"prompt": "hi", "echo": true, "stream": true}),
            400,
            "echo",
        ),
        (json!({"prompt": "hi", "best_of": 3}), 400, "best_of"),
        (json!({"prompt": "hi", "max_token": 3}), 400, "max_token"),
        (
            json!({"prompt": "hi", "logit_bias": {"x": 1}}),
            400,
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "logit_bias": {"5": 101}}),
            400,
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "logit_bias": {"999999": 1}}),
            400,
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "logit_bias": [1, 2]}),
            400,
            "logit_bias",
        ),
        (json!({"prompt": "hi", "logprobs": 50}), 400, "logprobs"),
        (json!({"prompt": "hi", "max_tokens": 100}), 400, "prompt"),
        (json!({"prompt": [1, 2, 999999]}), 400, "prompt"),
        (json!({"prompt": []}), 400, "prompt"),
        (json!({"n": 2}), 400, "prompt"),
        (json!({"prompt": "hi", "model": "nope"}), 404, "model"),
        (
            json!({"prompt": "hi", "frequency_penalty": 0.5}),
            400,
            "frequency_penalty",
        ),
        (
            json!({"prompt": "hi", "structured_outputs": {"json": {"type": "object"}}}),
            400,
            "structured_outputs.json",
        ),
        (
            json!({"prompt": "hi", "structured_outputs": {"regex": 5}}),
            400,
            "structured_outputs.regex",
        ),
        (
            json!({"prompt": "hi", "structured_outputs": {"choice": []}}),
            400,
            "structured_outputs.choice",
        ),
        (
            json!({"prompt": "hi", "structured_outputs": "[0-9]+"}),
            400,
            "structured_outputs",
        ),
        (
            json!({"prompt": "hi", "guided_regex": "("}),
            400,
            "guided_regex",
        ),
        (
            json!({"prompt": "hi", "structured_outputs": {"regex": "a"}, "guided_regex": "b"}),
            400,
            "guided_regex",
        ),
    ];
    for (body, status, field) in cases {
        let (st, got, _) = rt.block_on(post(&url, body.clone()));
        assert_eq!(st, status, "{body} -> {got}");
        assert_eq!(got["error"]["param"], field, "{body} -> {got}");
        let msg = got["error"]["message"].as_str().unwrap();
        assert!(msg.contains(field) && !msg.contains('\n'), "{msg}");
    }
    // Fields that ask for nothing are accepted.
    let (st, got, _) = rt.block_on(post(
        &format!("{}/chat/completions", srv.base_url()),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u1",
               "metadata": {"k": "v"}, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}, "seed": null}),
    ));
    assert_eq!(st, 200, "{got}");
    // Malformed JSON and wrong types: 400 with a message naming the problem.
    let (st, got, _) = rt.block_on(post(&url, json!({"prompt": "hi", "max_tokens": "many"})));
    assert_eq!(st, 400);
    assert!(
        got["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid request body"),
        "{got}"
    );
    let r = rt.block_on(async {
        reqwest::Client::new()
            .post(&url)
            .header("content-type", "application/json")
            .body("{oops")
            .send()
            .await
            .unwrap()
    });
    assert_eq!(r.status().as_u16(), 400);
    let (st, got, _) = rt.block_on(post(
        &format!("{}/chat/completions", srv.base_url()),
        json!({"messages": []}),
    ));
    assert_eq!(
        (st, got["error"]["param"].clone()),
        (400, json!("messages"))
    );
    // Still serving.
    assert_eq!(
        rt.block_on(post(&url, json!({"prompt": "hi", "max_tokens": 2})))
            .0,
        200
    );
}

#[test]
fn a_full_queue_answers_429_and_the_server_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |o| {
        o.max_queue = 1;
        o.max_batch_requests = 1;
    });
    let url = format!("{}/completions", srv.base_url());
    let rt = rt();
    let answers = rt.block_on(async {
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let url = url.clone();
                tokio::spawn(async move {
                    post(&url, json!({"prompt": "busy busy", "n": 4, "max_tokens": 48, "min_tokens": 48, "seed": i})).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let busy: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    let ok = answers.iter().filter(|a| a.0 == 200).count();
    assert!(!busy.is_empty(), "no request was turned away");
    // At least the first is served; whether the one queued behind it is depends on whether
    // the engine took the first off the queue before the burst arrived (a loaded machine: no).
    assert!(ok >= 1, "{ok} served");
    assert_eq!(busy.len() + ok, 16);
    for (_, body, retry) in &busy {
        assert_eq!(retry.as_deref(), Some("1"));
        assert!(body["error"]["message"].as_str().unwrap().contains("busy"));
    }
    let stats: Value = get_json(&rt, &format!("http://{}/stats", srv.addr));
    assert_eq!(
        stats["rejected_busy"].as_u64().unwrap() as usize,
        busy.len()
    );
    assert_eq!(
        rt.block_on(post(&url, json!({"prompt": "after", "max_tokens": 2})))
            .0,
        200
    );
}

/// The chunks of one choice, in order.
fn of_choice(chunks: &[Value], i: usize) -> Vec<&Value> {
    chunks
        .iter()
        .filter(|c| c["choices"].as_array().unwrap().len() == 1 && c["choices"][0]["index"] == i)
        .map(|c| &c["choices"][0])
        .collect()
}

/// The arrays under `key` of these values, concatenated.
fn concat(values: &[&Value], key: impl Fn(&Value) -> Value) -> Vec<Value> {
    values
        .iter()
        .flat_map(|v| key(v).as_array().cloned().unwrap_or_default())
        .collect()
}

#[test]
fn streamed_completions_add_up_to_the_answer_not_streamed() {
    let tmp = tempfile::tempdir().unwrap();
    model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let rt = rt();
    let body = json!({"model": "tiny", "prompt": ["one two", "three"], "n": 2, "max_tokens": 24,
                      "temperature": 1.0, "seed": 11, "logprobs": 2,
                      "return_tokens_as_token_ids": true, "return_token_ids": true});
    let (st, plain, _) = rt.block_on(post(&url, body.clone()));
    assert_eq!(st, 200, "{plain}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (st, kind, events, _) = rt.block_on(stream(&url, streamed.clone(), None));
    assert_eq!(st, 200);
    assert!(kind.starts_with("text/event-stream"), "{kind}");
    let chunks = chunks(&events);
    // One id and `created` throughout; the last chunk holds the usage and no choice.
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["model"], "tiny");
        assert_eq!(c["id"], chunks[0]["id"]);
        assert_eq!(c["created"], chunks[0]["created"]);
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], plain["usage"]);
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c.get("usage").is_none())
    );
    let want = plain["choices"].as_array().unwrap();
    for (i, w) in want.iter().enumerate() {
        let got = of_choice(&chunks, i);
        assert!(!got.is_empty(), "choice {i} has no chunk");
        let text: String = got.iter().map(|c| c["text"].as_str().unwrap()).collect();
        assert_eq!(text, w["text"].as_str().unwrap(), "choice {i}");
        // finish_reason only on the choice's last chunk.
        for c in &got[..got.len() - 1] {
            assert!(c["finish_reason"].is_null(), "{c}");
        }
        assert_eq!(got.last().unwrap()["finish_reason"], w["finish_reason"]);
        // Per-chunk log-probs add up to the whole answer's.
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            assert_eq!(
                concat(&got, |c| c["logprobs"][key].clone()),
                w["logprobs"][key].as_array().unwrap().clone(),
                "choice {i}: {key}"
            );
        }
        assert_eq!(
            concat(&got, |c| c["token_ids"].clone()),
            w["token_ids"].as_array().unwrap().clone()
        );
        assert_eq!(got[0]["prompt_token_ids"], w["prompt_token_ids"]);
    }
    // Without `stream_options.include_usage` there is no usage chunk.
    streamed.as_object_mut().unwrap().remove("stream_options");
    let (_, _, events, _) = rt.block_on(stream(&url, streamed, None));
    let chunks = self::chunks(&events);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(chunks.len(), events.len() - 1);
}

#[test]
fn streamed_chat_opens_with_the_role_and_adds_up_to_the_answer() {
    let tmp = tempfile::tempdir().unwrap();
    model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/chat/completions", srv.base_url());
    let rt = rt();
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}],
                      "n": 2, "max_tokens": 20, "temperature": 0.9, "seed": 4, "logprobs": true,
                      "top_logprobs": 2, "stop": ["e t", "an"]});
    let (st, plain, _) = rt.block_on(post(&url, body.clone()));
    assert_eq!(st, 200, "{plain}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let (st, kind, events, _) = rt.block_on(stream(&url, streamed, None));
    assert_eq!(st, 200);
    assert!(kind.starts_with("text/event-stream"), "{kind}");
    let chunks = chunks(&events);
    let mut used = 0;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
        assert_eq!(c["created"], chunks[0]["created"]);
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
        // continuous_usage_stats: every chunk carries the usage so far.
        let now = c["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(now >= used);
        used = now;
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], plain["usage"]);
    for (i, w) in plain["choices"].as_array().unwrap().iter().enumerate() {
        let got = of_choice(&chunks, i);
        assert_eq!(
            got[0]["delta"],
            json!({"role": "assistant", "content": ""}),
            "choice {i} opens with the role"
        );
        assert!(got[0]["finish_reason"].is_null());
        let text: String = got
            .iter()
            .map(|c| c["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(
            text,
            w["message"]["content"].as_str().unwrap(),
            "choice {i}"
        );
        for c in &got[..got.len() - 1] {
            assert!(c["finish_reason"].is_null(), "{c}");
        }
        assert_eq!(got.last().unwrap()["finish_reason"], w["finish_reason"]);
        assert_eq!(
            concat(&got, |c| c["logprobs"]["content"].clone()),
            w["logprobs"]["content"].as_array().unwrap().clone(),
            "choice {i}"
        );
    }
}

/// Tokens go out as the engine samples them: the first chunk arrives while the request is
/// still being generated (the server has not counted it as served yet).
#[test]
fn streaming_sends_tokens_as_they_are_sampled() {
    let tmp = tempfile::tempdir().unwrap();
    model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let stats = format!("http://{}/stats", srv.addr);
    let rt = rt();
    let body = json!({"prompt": "go", "max_tokens": 300, "min_tokens": 300, "seed": 1,
                      "stream": true, "return_token_ids": true});
    let (st, _, events, seen) = rt.block_on(stream(&url, body, Some(&stats)));
    assert_eq!(st, 200);
    assert_eq!(
        seen["requests"], 0,
        "the first chunk came after generation: {seen}"
    );
    let chunks = chunks(&events);
    assert!(chunks.len() > 10, "{} chunks", chunks.len());
    let ids = concat(
        &chunks.iter().map(|c| &c["choices"][0]).collect::<Vec<_>>(),
        |c| c["token_ids"].clone(),
    );
    assert_eq!(ids.len(), 300);
    assert_eq!(get_json(&rt, &stats)["requests"], 1);
}

/// A character made of several byte tokens is never split across chunks: `logit_bias` and a
/// repetition penalty make the model write the two byte tokens of `é`, then `a`; the first
/// byte alone decodes to U+FFFD, which must not be sent.
#[test]
fn streamed_text_never_splits_a_character() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let rt = rt();
    let bytes = m.tokenizer.encode("é", false).unwrap();
    assert_eq!(bytes.len(), 2, "é is two byte tokens");
    let a = m.tokenizer.encode("a", false).unwrap()[0];
    // Greedy: the first byte (+100), then the second (+50; the first is penalised to ~10),
    // then `a` (+20; both bytes are penalised).
    let bias = json!({bytes[0].to_string(): 100, bytes[1].to_string(): 50, a.to_string(): 20});
    let body = json!({"prompt": "x", "max_tokens": 3, "temperature": 0,
                      "repetition_penalty": 10.0, "logit_bias": bias});
    let (st, plain, _) = rt.block_on(post(&url, body.clone()));
    assert_eq!(st, 200, "{plain}");
    assert_eq!(plain["choices"][0]["text"], "éa");
    let deltas = |body: &Value| -> Vec<String> {
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, _, events, _) = rt.block_on(stream(&url, streamed, None));
        chunks(&events)
            .iter()
            .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(deltas(&body), ["é", "a"]);
    // Text that could still begin a stop string waits: with stop `éa` the answer is empty, and
    // so is every delta (`é` was held back).
    let mut stopped = body;
    stopped["stop"] = json!(["éa"]);
    let (_, plain, _) = rt.block_on(post(&url, stopped.clone()));
    assert_eq!(plain["choices"][0]["text"], "");
    assert_eq!(plain["choices"][0]["finish_reason"], "stop");
    assert_eq!(deltas(&stopped), [""]);
}

#[test]
fn logit_bias_forces_and_bans_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let rt = rt();
    let prompt: Vec<u32> = m.tokenizer.encode("What is 2 + 3?", false).unwrap();
    let ids = |body: &Value| -> Vec<u32> {
        body["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let greedy = |bias: Value| {
        let (st, body, _) = rt.block_on(post(
            &url,
            json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true,
                   "logit_bias": bias}),
        ));
        assert_eq!(st, 200, "{body}");
        ids(&body)
    };
    let plain = greedy(Value::Null);
    assert_eq!(
        plain,
        greedy_local(&m.model, &m.tokenizer, &prompt, 8).token_ids
    );
    // -100 bans the greedy first token.
    let banned = greedy(json!({plain[0].to_string(): -100}));
    assert!(!banned.contains(&plain[0]), "{banned:?} vs {plain:?}");
    // +100 forces a token at every step.
    let forced_id = m.tokenizer.encode("a", false).unwrap()[0];
    let forced = greedy(json!({forced_id.to_string(): 100.0}));
    assert_eq!(forced, vec![forced_id; 8]);
    // Sampling sees the bias as generate does locally.
    let (st, body, _) = rt.block_on(post(
        &url,
        json!({"prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 5,
               "return_token_ids": true, "logit_bias": {forced_id.to_string(): 3.5, plain[0].to_string(): -2}}),
    ));
    assert_eq!(st, 200, "{body}");
    let local = generate(
        &m.model.detached(),
        &m.tokenizer,
        std::slice::from_ref(&prompt),
        1,
        &SamplingParams {
            max_new_tokens: 8,
            temperature: 0.9,
            seed: 5,
            logit_bias: vec![(forced_id, 3.5), (plain[0], -2.0)],
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(ids(&body), local[0].token_ids);
}

/// vLLM's structured outputs: a regex (or a choice) constrains every completion, with the
/// tokens local generation samples under the same pattern and seed; the older `guided_*`
/// names, and chat completions, too.
#[test]
fn structured_outputs_constrain_completions_as_local_generation_does() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let rt = rt();
    let prompt: Vec<u32> = m.tokenizer.encode("What is 2 + 3?", false).unwrap();
    let texts = |body: &Value| -> Vec<String> {
        body["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect()
    };
    let digits = regex::Regex::new("^[0-9]{2,4}$").unwrap();
    for field in [
        json!({"structured_outputs": {"regex": "[0-9]{2,4}"}}),
        json!({"guided_regex": "[0-9]{2,4}"}),
    ] {
        let mut body = json!({"prompt": prompt, "max_tokens": 24, "n": 4, "seed": 3,
                              "return_token_ids": true});
        body.as_object_mut()
            .unwrap()
            .extend(field.as_object().unwrap().clone());
        let (st, got, _) = rt.block_on(post(&url, body));
        assert_eq!(st, 200, "{got}");
        for t in texts(&got) {
            assert!(digits.is_match(&t), "{t:?}");
        }
        let local = generate(
            &m.model.detached(),
            &m.tokenizer,
            std::slice::from_ref(&prompt),
            4,
            &SamplingParams {
                max_new_tokens: 24,
                seed: 3,
                regex: Some("[0-9]{2,4}".into()),
                ..Default::default()
            },
        )
        .unwrap();
        let ids: Vec<Vec<u32>> = got["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                c["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect();
        assert_eq!(
            ids,
            local
                .iter()
                .map(|c| c.token_ids.clone())
                .collect::<Vec<_>>()
        );
    }
    let colours = ["red", "green", "blue"];
    for choice in [
        json!({"structured_outputs": {"choice": colours}}),
        json!({"guided_choice": colours}),
    ] {
        let mut body = json!({"prompt": "My favourite colour is", "max_tokens": 24, "n": 6});
        body.as_object_mut()
            .unwrap()
            .extend(choice.as_object().unwrap().clone());
        let (st, got, _) = rt.block_on(post(&url, body));
        assert_eq!(st, 200, "{got}");
        for t in texts(&got) {
            assert!(colours.contains(&t.as_str()), "{t:?}");
        }
    }
    // A choice's strings are literal text, not patterns.
    let (st, got, _) = rt.block_on(post(
        &url,
        json!({"prompt": "hi", "max_tokens": 24, "n": 4,
               "structured_outputs": {"choice": ["a.b", "(x)"]}}),
    ));
    assert_eq!(st, 200, "{got}");
    for t in texts(&got) {
        assert!(t == "a.b" || t == "(x)", "{t:?}");
    }
    let (st, got, _) = rt.block_on(post(
        &format!("{}/chat/completions", srv.base_url()),
        json!({"messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 24,
               "n": 3, "structured_outputs": {"regex": "(yes|no)"}}),
    ));
    assert_eq!(st, 200, "{got}");
    for c in got["choices"].as_array().unwrap() {
        let t = c["message"]["content"].as_str().unwrap();
        assert!(t == "yes" || t == "no", "{t:?}");
        assert_eq!(c["finish_reason"], "stop");
    }
}

/// With `RUST_BACKTRACE=1` candle errors carry a backtrace; an error body still holds one line.
#[test]
fn errors_are_one_line_even_with_rust_backtrace() {
    let tmp = tempfile::tempdir().unwrap();
    model(&tmp.path().join("m"));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args([
            "serve",
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--model",
        ])
        .arg(tmp.path().join("m"))
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(base.starts_with("http://"), "{line}");
    let rt = rt();
    let (st, body, _) = rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{base}/completions"))
            .json(&json!({"prompt": "hi", "temperature": -1}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap(), ())
    });
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(st, 400, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["error"]["message"],
        "`temperature`: temperature must be >= 0, got -1"
    );
    assert_eq!(v["error"]["param"], "temperature");
}

/// `echo` with `logprobs`: the prompt's own tokens and log-probs (the first null) equal the
/// model's local log-probs, the top alternatives are the model's most likely tokens in order;
/// `max_tokens: 0` scores the prompt alone (lm-evaluation-harness's log-likelihood request:
/// prompt ids, `echo`, `max_tokens` 0, `logprobs` 1), and with tokens to generate the completion
/// follows the echoed prompt with its own log-probs, offsets running over both.
#[test]
fn echo_scores_the_prompt_as_the_model_does() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(&tmp.path().join("m"));
    let srv = server(&tmp.path().join("m"), |_| {});
    let url = format!("{}/completions", srv.base_url());
    let rt = rt();
    let text = "What is 2 + 3? It is 5.";
    let ids = m.tokenizer.encode(text, true).unwrap();
    // The model's own log-probs of each token after the first.
    let n = ids.len();
    let t = candle_core::Tensor::from_slice(&ids, (1, n), &Device::Cpu).unwrap();
    let mask = candle_core::Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
    let (lp, _) = m
        .model
        .completion_logprobs(&t, &mask, n - 1, 1.0, false)
        .unwrap();
    let want: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
    for prompt in [json!(text), json!(ids.clone())] {
        let (status, body, _) = rt.block_on(post(
            &url,
            json!({"prompt": prompt, "echo": true, "max_tokens": 0, "logprobs": 2, "temperature": 0}),
        ));
        assert_eq!(status, 200, "{body}");
        let c = &body["choices"][0];
        assert_eq!(c["text"], json!(text), "the prompt echoed");
        let lps = &c["logprobs"];
        assert_eq!(lps["tokens"].as_array().unwrap().len(), n);
        assert!(lps["token_logprobs"][0].is_null() && lps["top_logprobs"][0].is_null());
        for (k, w) in want.iter().enumerate() {
            let got = lps["token_logprobs"][k + 1].as_f64().unwrap() as f32;
            assert!((got - w).abs() < 1e-4, "token {k}: {got} vs {w}");
            // The alternatives: the token itself and the two most likely, none above the best.
            let top = lps["top_logprobs"][k + 1].as_object().unwrap();
            assert!(top.len() >= 2 && top.len() <= 3, "{top:?}");
            let best = top
                .values()
                .map(|v| v.as_f64().unwrap())
                .fold(f64::MIN, f64::max);
            assert!(best >= f64::from(got) - 1e-6);
        }
        let offsets: Vec<usize> = lps["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(body["usage"]["completion_tokens"], json!(0));
        assert_eq!(body["usage"]["prompt_tokens"], json!(n));
    }
    // With tokens to generate: the prompt, then the completion as without `echo`.
    let plain = json!({"prompt": text, "max_tokens": 4, "logprobs": 1, "temperature": 0});
    let mut echoed = plain.clone();
    echoed["echo"] = json!(true);
    let (_, a, _) = rt.block_on(post(&url, plain));
    let (_, b, _) = rt.block_on(post(&url, echoed));
    let (a, b) = (&a["choices"][0], &b["choices"][0]);
    assert_eq!(
        b["text"].as_str().unwrap(),
        format!("{text}{}", a["text"].as_str().unwrap())
    );
    let (ta, tb) = (
        f32s(&a["logprobs"]["token_logprobs"]),
        &b["logprobs"]["token_logprobs"],
    );
    let tb = tb.as_array().unwrap();
    assert_eq!(tb.len(), n + ta.len());
    for (k, x) in ta.iter().enumerate() {
        assert!((tb[n + k].as_f64().unwrap() as f32 - x).abs() < 1e-5);
    }
    // Echo without logprobs: the text alone.
    let (_, c, _) = rt.block_on(post(
        &url,
        json!({"prompt": text, "echo": true, "max_tokens": 0}),
    ));
    assert_eq!(c["choices"][0]["text"], json!(text));
    assert!(c["choices"][0]["logprobs"].is_null());
}
