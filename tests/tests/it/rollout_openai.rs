//! `rollout.backend = "openai"` against `grpo-cli serve` on loopback: the LoRA policy is synced
//! to the server every step, a tiny model learns as it does with the local backend, and a
//! server that is down or hangs gives a clear error instead of a hang.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::time::{Duration, Instant};

use grpo_cli::serve::{ServeOptions, start};
use grpo_data::synth::ArithmeticConfig;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

/// A tiny random model whose embeddings are scaled ×5: with init's 0.02 the logits cannot get
/// sharp, and LoRA (which cannot touch the tied embeddings) could not move the distribution.
fn fixture(root: &Path) {
    init_model_dir(&root.join("model"), Preset::Tiny, Arch::Qwen2, 5).unwrap();
    let f = root.join("model/model.safetensors");
    let mut t = candle_core::safetensors::load(&f, &candle_core::Device::Cpu).unwrap();
    let e = (t["model.embed_tokens.weight"].clone() * 5.0).unwrap();
    t.insert("model.embed_tokens.weight".into(), e);
    candle_core::safetensors::save(&t, &f).unwrap();
    ArithmeticConfig {
        n: 32,
        seed: 2,
        digits: 1,
        steps: 1,
    }
    .write(&root.join("d.jsonl"))
    .unwrap();
}

/// `grpo-cli serve` of the fixture's model as `tiny`, on a free loopback port.
fn serve(root: &Path) -> grpo_cli::serve::Server {
    let mut o = ServeOptions::new(root.join("model"));
    o.served_model_name = "tiny".into();
    o.addr = "127.0.0.1:0".parse().unwrap();
    start(o).unwrap()
}

/// A teacher (another random model) at `root/teacher`, served by `grpo-cli serve` as
/// `teacher`.
fn serve_teacher(root: &Path) -> grpo_cli::serve::Server {
    init_model_dir(&root.join("teacher"), Preset::Tiny, Arch::Qwen2, 11).unwrap();
    let mut o = ServeOptions::new(root.join("teacher"));
    o.served_model_name = "teacher".into();
    o.addr = "127.0.0.1:0".parse().unwrap();
    start(o).unwrap()
}

/// A whole run of `c`.
fn run_config(c: TrainConfig) -> grpo_trainer::TrainingResult {
    trainer::run(
        trainer::setup(c).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

/// Reward: completions that start with white space (a quarter of the model's at first).
fn config(root: &Path, out: &str, extra: &str) -> TrainConfig {
    let text = format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[model.lora]
r = 8
lora_alpha = 16
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[data]
path = ["{data}"]
[rollout]
num_generations = 8
max_completion_length = 4
{extra}
[[rewards]]
type = "format"
name = "no_e"
pattern = '(?s)\s.*'
[optim]
learning_rate = 2e-2
[train]
max_steps = 24
prompts_per_step = 8
per_device_train_batch_size = 64
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("d.jsonl").display(),
    );
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, text).unwrap();
    config::load(&p, &[]).unwrap()
}

fn rewards(r: &grpo_trainer::TrainingResult) -> Vec<f64> {
    r.metrics.iter().map(|m| m["reward"]).collect()
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

#[test]
fn the_openai_backend_trains_like_the_local_one() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve(root);

    let local = trainer::run(
        trainer::setup(config(root, "local", "")).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    eprintln!("local  {:?}", rewards(&local));
    let remote_extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\nmodel = \"tiny\"\n",
        srv.base_url()
    );
    let remote = trainer::run(
        trainer::setup(config(root, "remote", &remote_extra)).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    let (l, r) = (rewards(&local), rewards(&remote));
    eprintln!("remote {r:?}");
    assert_eq!(r.len(), 24);
    // Both learn.
    for x in [&l, &r] {
        assert!(mean(&x[16..]) > mean(&x[..4]) + 0.1, "{x:?}");
    }
    // Same engine, same seeds: the first step's rollouts are the local ones exactly, and so is
    // its update (importance weights ~1). Later steps are not compared one for one: weights of
    // 1 ± 1e-6 change the update in the last float bits, and sampling amplifies that into a
    // different (equally valid) trajectory after a few steps.
    assert_eq!(l[0], r[0]);
    let (ll, rl) = (local.metrics[0]["loss"], remote.metrics[0]["loss"]);
    assert!(
        (ll - rl).abs() < 1e-4 * ll.abs().max(1.0),
        "first-step loss {ll} vs {rl}"
    );
    // The server's log-probs are the learner's: importance weights ~1.
    for m in &remote.metrics {
        let d = m["sampling/sampling_logp_difference/mean"];
        assert!(d < 1e-3, "logp difference {d}");
    }
    // One adapter per step went to the server; only the last one's files remain.
    let stats: serde_json::Value = {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async { reqwest_get(&format!("http://{}/stats", srv.addr)).await })
    };
    assert_eq!(stats["requests"], 24);
    // Stopping after 2 steps and resuming against the same server (which still holds the
    // adapter of the version the run resumes from) gives the uninterrupted run.
    let resumed_cfg = || config(root, "resumed", &remote_extra);
    let first = trainer::run(
        trainer::setup(resumed_cfg()).unwrap(),
        &RunOptions {
            stop_after: Some(2),
            ..Default::default()
        },
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    let rest = trainer::run(
        trainer::setup(resumed_cfg()).unwrap(),
        &RunOptions {
            resume: Some(None),
            ..Default::default()
        },
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    let mut joined = rewards(&first);
    joined.extend(rewards(&rest));
    assert_eq!(joined, r);
    let left: Vec<_> = std::fs::read_dir(root.join("remote/rollout_adapters"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, vec!["step-23".to_string()]);
    // A new client syncing a name the server already holds (a restarted trainer) replaces it.
    let cfg = grpo_rollout::remote::RemoteConfig {
        base_url: srv.base_url(),
        ..Default::default()
    };
    let adapter = root.join("remote/rollout_adapters/step-23");
    let mut client = grpo_rollout::remote::RemoteGenerator::connect(cfg).unwrap();
    client.sync_adapter("policy-step-23", &adapter).unwrap();
    assert_eq!(client.adapter(), Some("policy-step-23"));
}

async fn reqwest_get(url: &str) -> serde_json::Value {
    // A plain HTTP/1.1 GET over tokio, to keep this test's dependencies small.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').unwrap();
    let mut s = tokio::net::TcpStream::connect(host).await.unwrap();
    s.write_all(
        format!("GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let body = buf.split_once("\r\n\r\n").unwrap().1;
    serde_json::from_str(body).unwrap()
}

/// `rollout.structured_outputs_regex` (TRL's `vllm_structured_outputs_regex`) constrains every
/// completion of a run, sampled here or on the server.
#[test]
fn a_regex_constrains_the_rollouts_locally_and_on_the_server() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve(root);
    let re = regex::Regex::new("^ [0-9]{1,2}$").unwrap();
    for (out, backend) in [
        ("local", String::new()),
        (
            "remote",
            format!(
                "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\n",
                srv.base_url()
            ),
        ),
    ] {
        let extra = format!("structured_outputs_regex = ' [0-9]{{1,2}}'\n{backend}");
        let mut c = config(root, out, &extra);
        c.rollout.max_completion_length = 8;
        c.train.max_steps = Some(2);
        c.train.num_completions_to_print = 64;
        run_config(c);
        let log = std::fs::read_to_string(root.join(out).join("completions.jsonl")).unwrap();
        let rows: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 2 * 8 * 8, "{out}");
        for r in &rows {
            let text = r["completion"].as_str().unwrap();
            assert!(re.is_match(text), "{out}: {text:?}");
            assert_eq!(r["finish_reason"], "eos", "{out}: {r}");
        }
    }
}

#[test]
fn a_server_that_is_down_or_hangs_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    // Nothing listens: setup fails at once, naming the URL.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"http://127.0.0.1:{port}/v1\"\nmax_retries = 0\n"
    );
    let e = trainer::setup(config(root, "down", &extra))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rollout.openai") && e.contains(&format!("127.0.0.1:{port}")),
        "{e}"
    );

    // A server that lists its model but never answers a LoRA load: the first step fails after
    // sync_timeout, naming the sync, and a checkpoint is not lost.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        use axum::routing::{get, post};
        let app = axum::Router::new()
            .route(
                "/v1/models",
                get(|| async { axum::Json(serde_json::json!({"data": [{"id": "tiny"}]})) }),
            )
            .route(
                "/v1/load_lora_adapter",
                post(|| async {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    "never"
                }),
            );
        axum::serve(listener, app).await.unwrap();
    });
    let extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"http://{addr}/v1\"\nsync_timeout = 1.0\nmax_retries = 0\n"
    );
    let t0 = Instant::now();
    let e = trainer::run(
        trainer::setup(config(root, "hang", &extra)).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    assert!(
        msg.contains("generator stage") && msg.contains("LoRA sync") && msg.contains("timed out"),
        "{msg}"
    );

    // Full-weight training cannot sync: refused at config time.
    let mut c = config(
        root,
        "full",
        &format!("backend = \"openai\"\n[rollout.openai]\nbase_url = \"http://{addr}/v1\"\n"),
    );
    c.model.lora = None;
    let e = trainer::setup(c).unwrap_err().to_string();
    assert!(e.contains("[model.lora]"), "{e}");
}

/// What the scripted server below saw.
#[derive(Default)]
struct Seen {
    completions: Vec<serde_json::Value>,
    loads: u32,
    authorizations: Vec<Option<String>>,
}

/// A vLLM stand-in whose `/v1/completions` first answers 429 with `Retry-After` as an HTTP
/// date, and whose `/v1/load_lora_adapter` first answers 503 with `Retry-After: 2`.
fn scripted_vllm(
    rt: &tokio::runtime::Runtime,
    retry_at: std::sync::Arc<std::sync::Mutex<Option<String>>>,
) -> (std::net::SocketAddr, std::sync::Arc<std::sync::Mutex<Seen>>) {
    use axum::http::{HeaderMap, StatusCode, header};
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    use std::sync::{Arc, Mutex};
    let seen = Arc::new(Mutex::new(Seen::default()));
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let auth = |h: &HeaderMap| {
        h.get(header::AUTHORIZATION)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (s1, s2, s3) = (seen.clone(), seen.clone(), seen.clone());
    let app = axum::Router::new()
        .route(
            "/v1/models",
            get(move |h: HeaderMap| async move {
                s1.lock().unwrap().authorizations.push(auth(&h));
                axum::Json(serde_json::json!({"object": "list", "data": [{"id": "tiny"}]}))
            }),
        )
        .route(
            "/v1/completions",
            post(
                move |h: HeaderMap, axum::Json(body): axum::Json<serde_json::Value>| async move {
                    let mut s = s2.lock().unwrap();
                    s.authorizations.push(auth(&h));
                    s.completions.push(body);
                    if let Some(at) = retry_at.lock().unwrap().take() {
                        return (
                            StatusCode::TOO_MANY_REQUESTS,
                            [(header::RETRY_AFTER, at)],
                            axum::Json(serde_json::json!({"error": {"message": "slow down"}})),
                        )
                            .into_response();
                    }
                    axum::Json(serde_json::json!({"choices": [{
                        "index": 0, "text": "hi", "token_ids": [7, 8, 9],
                        "finish_reason": "length",
                        "logprobs": {"tokens": ["token_id:7", "token_id:8", "token_id:9"],
                                     "token_logprobs": [-0.5, -0.25, -0.125]}
                    }]}))
                    .into_response()
                },
            ),
        )
        .route(
            "/v1/load_lora_adapter",
            post(move |h: HeaderMap| async move {
                let mut s = s3.lock().unwrap();
                s.authorizations.push(auth(&h));
                s.loads += 1;
                if s.loads == 1 {
                    return (
                        StatusCode::SERVICE_UNAVAILABLE,
                        [(header::RETRY_AFTER, "2".to_string())],
                        "busy",
                    )
                        .into_response();
                }
                "Success: LoRA adapter 'a' added successfully.".into_response()
            }),
        );
    rt.spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, seen)
}

#[test]
fn the_client_sends_vllm_fields_and_waits_for_retry_after() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let retry_at = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (addr, seen) = scripted_vllm(&rt, retry_at.clone());
    let mut client =
        grpo_rollout::remote::RemoteGenerator::connect(grpo_rollout::remote::RemoteConfig {
            base_url: format!("http://{addr}/v1"),
            api_key: "sekrit".into(),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(client.served_model(), "tiny");
    let tok = grpo_rollout::init::train_tokenizer(400).unwrap();
    let params = grpo_rollout::SamplingParams {
        max_new_tokens: 3,
        top_k: 5,
        seed: 11,
        ..Default::default()
    };
    let generate = |c: &grpo_rollout::remote::RemoteGenerator| {
        let t0 = Instant::now();
        let out = c
            .generate(&tok, &[vec![1, 2, 3]], 1, &params, false)
            .unwrap();
        assert_eq!(out[0].token_ids, vec![7, 8, 9]);
        assert_eq!(out[0].logprobs, vec![-0.5, -0.25, -0.125]);
        t0.elapsed()
    };

    // 429 with an HTTP date 3 s ahead (one-second resolution: a wait in (2, 3] s, where the
    // client's own first backoff is 0.5-1 s), then an answer.
    *retry_at.lock().unwrap() = Some(httpdate::fmt_http_date(
        std::time::SystemTime::now() + Duration::from_secs(3),
    ));
    let waited = generate(&client);
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(6),
        "Retry-After date honoured: {waited:?}"
    );
    // A date in the past: retried at once, below the client's own 0.5 s minimum backoff.
    *retry_at.lock().unwrap() = Some("Wed, 21 Oct 2015 07:28:00 GMT".into());
    let waited = generate(&client);
    assert!(waited < Duration::from_millis(450), "{waited:?}");
    {
        let s = seen.lock().unwrap();
        assert_eq!(s.completions.len(), 4);
        // vLLM's extensions, with the prompt as token ids.
        let b = &s.completions[0];
        assert_eq!(b["prompt"], serde_json::json!([[1, 2, 3]]));
        assert_eq!(b["model"], "tiny");
        assert_eq!(b["return_token_ids"], true);
        assert_eq!(b["return_tokens_as_token_ids"], true);
        assert_eq!(b["logprobs"], 0);
        assert_eq!(b["top_k"], 5);
        assert_eq!(b["seed"], 11);
        assert!(
            b.get("min_p").is_none()
                && b.get("stop").is_none()
                && b.get("structured_outputs").is_none(),
            "{b}"
        );
    }
    // A regex goes as vLLM's `structured_outputs`.
    *retry_at.lock().unwrap() = None;
    let regex = grpo_rollout::SamplingParams {
        regex: Some("[0-9]+".into()),
        ..params.clone()
    };
    client
        .generate(&tok, &[vec![1, 2, 3]], 1, &regex, false)
        .unwrap();
    assert_eq!(
        seen.lock().unwrap().completions[4]["structured_outputs"],
        serde_json::json!({"regex": "[0-9]+"})
    );

    // The LoRA load: 503 with `Retry-After: 2` (delta-seconds), then plain-text success.
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    client.sync_adapter("a", dir.path()).unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(6),
        "Retry-After seconds honoured: {waited:?}"
    );
    assert_eq!(client.adapter(), Some("a"));
    let s = seen.lock().unwrap();
    assert_eq!(s.loads, 2);
    // The key went with every request, the LoRA ones included.
    assert_eq!(s.authorizations.len(), 1 + 5 + 2);
    assert!(
        s.authorizations
            .iter()
            .all(|a| a.as_deref() == Some("Bearer sekrit")),
        "{:?}",
        s.authorizations
    );
}

/// Says "Try again." until the third turn; a turn's reward is its length modulo 3, over 3.
/// With `own_prompts`, `reset` gives every episode a prompt of its own.
struct TryAgain {
    own_prompts: bool,
}

impl grpo_rollout::Environment for TryAgain {
    fn name(&self) -> &str {
        "try_again"
    }

    fn reset(
        &self,
        metadata: &[&serde_json::Value],
        n: usize,
    ) -> candle_core::Result<Vec<grpo_rollout::EnvironmentReset>> {
        Ok(metadata
            .iter()
            .enumerate()
            .map(|(p, m)| {
                let starts = (0..n)
                    .map(|j| grpo_rollout::EpisodeStart {
                        observation: Some(match self.own_prompts {
                            true => format!(" Episode {p}.{j}, keep going."),
                            false => " Keep going.".into(),
                        }),
                        messages: Vec::new(),
                    })
                    .collect();
                grpo_rollout::EnvironmentReset::from_starts(starts, vec![(*m).clone(); n])
            })
            .collect())
    }

    fn step(
        &self,
        logs: &[&[grpo_rollout::ChatMessage]],
        _: &[&serde_json::Value],
    ) -> candle_core::Result<grpo_rollout::EnvironmentReturn> {
        let mut r = grpo_rollout::EnvironmentReturn::empty(logs.len());
        for (i, log) in logs.iter().enumerate() {
            let text = &log.last().unwrap().content;
            r.rewards[i] = (text.len() % 3) as f32 / 3.0;
            r.observations[i] = Some(grpo_rollout::ChatMessage::new("user", "Try again."));
            r.metadata[i] = serde_json::Value::Null;
        }
        Ok(r)
    }
}

#[test]
fn episodes_run_through_the_openai_backend() {
    for own_prompts in [false, true] {
        episodes_through_the_openai_backend(own_prompts);
    }
}

fn episodes_through_the_openai_backend(own_prompts: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve(root);
    let extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\nmodel = \"tiny\"\n[environment]\nmax_turns = 3\nmax_total_tokens = 80\n",
        srv.base_url()
    );
    let mut cfg = config(root, "episodes", &extra);
    cfg.train.max_steps = Some(2);
    let mut setup = trainer::setup(cfg).unwrap();
    setup.environment = Some(std::sync::Arc::new(TryAgain { own_prompts }));
    let r = trainer::run(
        setup,
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    assert_eq!(r.metrics.len(), 2);
    for m in &r.metrics {
        // Three turns each (the environment never ends an episode), sampled on the server.
        assert_eq!(m["env/turns_mean"], 3.0, "{m:?}");
        assert!(m["episodes/environment_tokens"] > 0.0, "{m:?}");
        // The server's token ids and log-probs are the learner's at every model token: the
        // observations were appended as our template renders them, masked out of the loss.
        let d = m["sampling/sampling_logp_difference/mean"];
        assert!(d < 1e-3, "logp difference {d}");
    }
    let text = std::fs::read_to_string(root.join("episodes/completions.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let transcript = first["completion"].as_str().unwrap();
    assert_eq!(transcript.matches("Try again.").count(), 2, "{transcript}");
    // Each episode of the first step started from its own prompt (or a group from its one).
    let step1: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["step"] == 1)
        .collect();
    let prompts: std::collections::BTreeSet<&str> = step1
        .iter()
        .map(|v| v["prompt"].as_str().unwrap())
        .collect();
    let lines = step1.len();
    match own_prompts {
        true => assert_eq!(prompts.len(), lines, "{prompts:?}"),
        false => assert!(prompts.len() < lines, "{prompts:?}"),
    }
}

/// On-policy distillation with its samples from the server: the synced LoRA student samples on
/// `grpo-cli serve`, and the first step equals the local backend's (same engine, same seeds:
/// the same completions, so the same divergence from the teacher).
#[test]
fn distillation_samples_through_the_openai_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    init_model_dir(&root.join("teacher"), Preset::Tiny, Arch::Qwen2, 11).unwrap();
    let srv = serve(root);
    let distill = |out: &str, extra: &str| {
        let mut c = config(root, out, extra);
        c.algorithm = grpo_trainer::Algorithm::Distillation;
        c.distillation.teacher_model_name_or_path = Some(root.join("teacher"));
        c.rewards.clear();
        c.train.max_steps = Some(3);
        c.optim.learning_rate = Some(1e-3);
        trainer::run(
            trainer::setup(c).unwrap(),
            &RunOptions::default(),
            &mut grpo_trainer::NoCallbacks,
        )
        .unwrap()
    };
    let local = distill("d-local", "");
    let remote_extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\nmodel = \"tiny\"\n",
        srv.base_url()
    );
    let remote = distill("d-remote", &remote_extra);
    assert_eq!(remote.metrics.len(), 3);
    let (l, r) = (local.metrics[0]["loss"], remote.metrics[0]["loss"]);
    assert!(
        l > 0.0 && (l - r).abs() < 1e-4 * l,
        "first-step loss {l} vs {r}"
    );
    assert!(remote.metrics.iter().all(|m| m["loss"].is_finite()));
}

/// SDPO and IW-OPD with their samples from the server: the first step equals the local
/// backend's (the same completions; IW-OPD's rollout log-probs then come from the server, equal
/// to the student's own to the engine's rounding).
#[test]
fn sdpo_and_iw_opd_sample_through_the_openai_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    init_model_dir(&root.join("teacher"), Preset::Tiny, Arch::Qwen2, 11).unwrap();
    let srv = serve(root);
    let remote_extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\nmodel = \"tiny\"\n",
        srv.base_url()
    );
    let train = |out: &str, extra: &str, algorithm: grpo_trainer::Algorithm| {
        let mut c = config(root, out, extra);
        c.algorithm = algorithm;
        c.distillation.teacher_model_name_or_path = Some(root.join("teacher"));
        c.sdpo.success_reward_threshold = 0.0;
        c.sdpo.teacher_model_kind = grpo_trainer::config::SdpoTeacher::Live;
        c.train.max_steps = Some(2);
        c.optim.learning_rate = Some(1e-3);
        if algorithm == grpo_trainer::Algorithm::IwOpd {
            c.rewards.clear();
        }
        run_config(c)
    };
    for algorithm in [
        grpo_trainer::Algorithm::Sdpo,
        grpo_trainer::Algorithm::IwOpd,
    ] {
        let name = algorithm.as_str();
        let local = train(&format!("{name}-local"), "", algorithm);
        let remote = train(&format!("{name}-remote"), &remote_extra, algorithm);
        assert_eq!(remote.metrics.len(), 2);
        let (l, r) = (local.metrics[0]["loss"], remote.metrics[0]["loss"]);
        assert!(
            l.abs() > 0.0 && (l - r).abs() < 1e-3 * l.abs(),
            "{name}: first-step loss {l} vs {r}"
        );
    }
}

/// XPO through the rollout server: the synced adapter samples each prompt's first completion
/// and the served base model (the frozen reference) its second, with the seeds the local
/// backend draws them with: the first step's pairs, rewards and loss are the local ones.
#[test]
fn xpo_samples_policy_and_reference_through_the_openai_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve(root);
    let remote_extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\nmodel = \"tiny\"\n",
        srv.base_url()
    );
    let train = |out: &str, extra: &str| {
        let mut c = config(root, out, extra);
        c.algorithm = grpo_trainer::Algorithm::Xpo;
        c.rollout.num_generations = 2;
        c.train.per_device_train_batch_size = Some(4);
        c.train.max_steps = Some(3);
        c.optim.learning_rate = Some(1e-3);
        run_config(c)
    };
    let local = train("xpo-local", "");
    let remote = train("xpo-remote", &remote_extra);
    assert_eq!(remote.metrics.len(), 3);
    let (l, r) = (&local.metrics[0], &remote.metrics[0]);
    for k in ["objective/model_scores", "objective/ref_scores"] {
        assert_eq!(l[k], r[k], "{k}");
    }
    assert!(
        (l["loss"] - r["loss"]).abs() < 1e-4 * l["loss"].abs().max(1.0),
        "first-step loss {} vs {}",
        l["loss"],
        r["loss"]
    );
    assert!(
        remote
            .metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m["loss/xpo"].is_finite())
    );
}

/// PPO with its samples from `grpo-cli serve` (`rollout.backend = "openai"`): the first step
/// equals the local one (the same samples, scores, value loss and loss), and the value model
/// trains through the remote run.
#[test]
fn ppo_samples_through_the_openai_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve(root);
    let remote_extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\nmodel = \"tiny\"\n",
        srv.base_url()
    );
    let train = |out: &str, extra: &str| {
        let mut c = config(root, out, extra);
        c.algorithm = grpo_trainer::Algorithm::Ppo;
        c.rollout.num_generations = 2;
        c.train.per_device_train_batch_size = Some(4);
        c.train.max_steps = Some(3);
        c.optim.learning_rate = Some(1e-3);
        c.validate().unwrap();
        run_config(c)
    };
    let local = train("ppo-local", "");
    let remote = train("ppo-remote", &remote_extra);
    assert_eq!(remote.metrics.len(), 3);
    let (l, r) = (&local.metrics[0], &remote.metrics[0]);
    assert_eq!(l["objective/scores"], r["objective/scores"]);
    for k in ["loss", "loss/value_avg"] {
        assert!(
            (l[k] - r[k]).abs() < 1e-4 * l[k].abs().max(1.0),
            "first-step {k} {} vs {}",
            l[k],
            r[k]
        );
    }
    assert!(
        remote
            .metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m["grad_norm"] > 0.0)
    );
}

/// IW-OPD with its teacher on a server (`[distillation.teacher_server]`): the teacher's
/// log-probs come from `grpo-cli serve`'s `echo`, and the steps equal those with the same
/// teacher loaded locally.
#[test]
fn iw_opd_scores_with_a_teacher_on_a_server() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve_teacher(root);
    let train = |out: &str, served: bool| {
        let mut c = config(root, out, "");
        c.algorithm = grpo_trainer::Algorithm::IwOpd;
        if served {
            c.distillation.teacher_server = Some(grpo_trainer::config::TeacherServer {
                base_url: srv.base_url(),
                model: "teacher".into(),
                ..Default::default()
            });
        } else {
            c.distillation.teacher_model_name_or_path = Some(root.join("teacher"));
        }
        c.rewards.clear();
        c.train.max_steps = Some(2);
        c.optim.learning_rate = Some(1e-3);
        c.validate().unwrap();
        run_config(c)
    };
    let local = train("iw-local", false);
    let served = train("iw-served", true);
    for (a, b) in local.metrics.iter().zip(&served.metrics) {
        for key in ["loss", "iw_opd/mean_advantage", "iw_opd/mean_weight"] {
            assert!(
                (a[key] - b[key]).abs() < 1e-4 * a[key].abs().max(1e-3),
                "{key}: {} vs {}",
                a[key],
                b[key]
            );
        }
    }
}

/// Distillation with its teacher on a server (TRL's ServerDistillationTrainer, and IW-OPD's
/// `jsd` objective there): the teacher's top-k and sampled-token log-probs come from `grpo-cli
/// serve`'s `echo` with `logprobs`, and the steps equal those with the same teacher loaded
/// locally and the same sparse support — the top-1 support at β = 1 (TRL's defaults) and 0.5,
/// the teacher's top 3 at β = 0; the supports a server cannot give are refused.
#[test]
fn distillation_takes_the_sparse_divergence_with_a_teacher_on_a_server() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve_teacher(root);
    let server = grpo_trainer::config::TeacherServer {
        base_url: srv.base_url(),
        model: "teacher".into(),
        ..Default::default()
    };
    let train = |out: &str, served: bool, beta: f64, k: Option<usize>| {
        let mut c = config(root, out, "");
        c.algorithm = grpo_trainer::Algorithm::Distillation;
        c.distillation.beta = beta;
        if served {
            c.distillation.teacher_server = Some(server.clone());
        } else {
            c.distillation.teacher_model_name_or_path = Some(root.join("teacher"));
            // The served path's default support, spelled out for the local teacher.
            c.distillation.loss_top_k = Some(k.unwrap_or(1));
        }
        if served {
            c.distillation.loss_top_k = k;
        }
        c.rewards.clear();
        c.train.max_steps = Some(2);
        c.optim.learning_rate = Some(1e-3);
        c.validate().unwrap();
        run_config(c)
    };
    for (beta, k) in [(1.0, None), (0.5, None), (0.0, Some(3))] {
        let local = train(&format!("sd-local-{beta}"), false, beta, k);
        let served = train(&format!("sd-served-{beta}"), true, beta, k);
        assert_eq!(served.metrics.len(), 2);
        for (a, b) in local.metrics.iter().zip(&served.metrics) {
            let (l, r) = (a["loss"], b["loss"]);
            assert!(
                l > 0.0 && (l - r).abs() < 1e-4 * l,
                "beta {beta}: loss {l} (local) vs {r} (served)"
            );
        }
    }
    // The full vocabulary, a wider support with β > 0 and the student's arg-max token need
    // what a server does not give.
    for (beta, k, argmax, want) in [
        (
            1.0,
            Some(0),
            false,
            "`distillation.loss_top_k` must be at least 1",
        ),
        (
            0.5,
            Some(2),
            false,
            "`distillation.loss_top_k` must be 1, got 2",
        ),
        (1.0, None, true, "needs a local teacher"),
    ] {
        let mut c = config(root, "refused", "");
        c.algorithm = grpo_trainer::Algorithm::Distillation;
        c.distillation.teacher_server = Some(server.clone());
        c.distillation.beta = beta;
        c.distillation.loss_top_k = k;
        if argmax {
            c.distillation.reverse_kl_top_1_mode = grpo_trainer::config::ReverseKlTop1Mode::Argmax;
        }
        let e = c.validate().unwrap_err();
        assert!(e.contains(want), "{e}");
    }
}

/// SDPO's and SDFT's `use_teacher_server`: the live teacher's log-probs of the reprompted
/// completions come from the server's synced adapter (`echo`), and the steps equal those scored
/// locally.
#[test]
fn sdpo_scores_the_live_teacher_on_the_rollout_server() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fixture(root);
    let srv = serve(root);
    let extra = format!(
        "backend = \"openai\"\n[rollout.openai]\nbase_url = \"{}\"\nmodel = \"tiny\"\n",
        srv.base_url()
    );
    let train = |out: &str, served: bool| {
        let mut c = config(root, out, &extra);
        c.algorithm = grpo_trainer::Algorithm::Sdpo;
        c.sdpo.success_reward_threshold = 0.5;
        c.sdpo.teacher_model_kind = grpo_trainer::config::SdpoTeacher::Live;
        c.sdpo.use_teacher_server = served;
        c.train.max_steps = Some(3);
        c.optim.learning_rate = Some(1e-3);
        c.validate().unwrap();
        run_config(c)
    };
    let local = train("sd-local", false);
    let served = train("sd-served", true);
    assert_eq!(served.metrics.len(), 3);
    for (a, b) in local.metrics.iter().zip(&served.metrics) {
        let (x, y) = (a["loss"], b["loss"]);
        assert!((x - y).abs() < 1e-3 * x.abs().max(1e-3), "loss {x} vs {y}");
    }
    assert!(local.metrics[0]["loss"].abs() > 0.0);
    // SDFT likewise (its teacher prompt: the row's answer as the privileged context).
    let sdft = |out: &str, served: bool| {
        let mut c = config(root, out, &extra);
        c.algorithm = grpo_trainer::Algorithm::Sdft;
        c.sdft.privileged_context_field = "answer".into();
        c.sdft.distillation_mode = grpo_trainer::config::SdpoMode::SampledToken;
        c.sdft.distillation_alpha = 1.0;
        c.sdft.teacher_model_kind = grpo_trainer::config::SdpoTeacher::Live;
        c.sdft.use_teacher_server = served;
        c.rewards.clear();
        c.train.max_steps = Some(2);
        c.optim.learning_rate = Some(1e-3);
        c.validate().unwrap();
        run_config(c)
    };
    let (a, b) = (sdft("ft-local", false), sdft("ft-served", true));
    for (a, b) in a.metrics.iter().zip(&b.metrics) {
        let (x, y) = (a["loss"], b["loss"]);
        assert!(
            (x - y).abs() < 1e-3 * x.abs().max(1e-3),
            "sdft loss {x} vs {y}"
        );
    }
    // Without the rollout server there is nothing to score on.
    let mut c = config(root, "nosrv", "");
    c.algorithm = grpo_trainer::Algorithm::Sdpo;
    c.sdpo.teacher_model_kind = grpo_trainer::config::SdpoTeacher::Live;
    c.sdpo.use_teacher_server = true;
    let e = c.validate().unwrap_err();
    assert!(
        e.contains("`sdpo.use_teacher_server` needs `rollout.backend"),
        "{e}"
    );
}
