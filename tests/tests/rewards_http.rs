//! `type = "http"` rewards against the loopback server's `POST /rewards`: the request is TRL's
//! reward-function arguments (columns, `trainer_state`, conversational messages) with the
//! bearer token and static headers; `Retry-After`, 5xx and timeouts are retried with the one
//! retry policy; a server that stays down, a 4xx or a malformed answer fails the batch naming
//! the reward, the URL and the sample, never the token; `max_concurrent` and `batch_size` hold;
//! and a training run whose reward service goes down stops with a checkpoint.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use grpo_rewards::http::{HttpReward, HttpRewardConfig};
use grpo_rewards::{
    AsyncReward, Message, RewardError, RewardInput, RewardOutput, RewardsConfig, ScoringModels,
};
use grpo_tests::loopback::{Fault, LoopbackServer, ServerConfig};
use serde_json::{Value, json};

const VAR: &str = "GRPO_HTTP_REWARD_TEST_TOKEN";
const KEY: &str = "rm-token-5f0c2a9e-TOPSECRET";

/// Sets the token's variable once. Every test calls this first, so no test thread reads the
/// environment while it is written.
fn key_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        #[allow(unsafe_code)]
        // SAFETY: every test of this binary calls `key_env` before anything else, so the other
        // test threads wait in `call_once` while the variable is set.
        unsafe {
            std::env::set_var(VAR, KEY)
        };
    });
}

/// A config for `url` with fast computed backoffs (so that only a `Retry-After` waits long).
fn config(url: String) -> HttpRewardConfig {
    let mut c = HttpRewardConfig::new(url);
    c.initial_backoff_ms = 10;
    c.max_backoff_ms = 20;
    c
}

fn samples(n: usize) -> Vec<RewardInput> {
    (0..n)
        .map(|i| RewardInput::new(format!("p{i}"), format!("SCORE={i}")).at_step(3))
        .collect()
}

fn scores(out: &RewardOutput) -> Vec<Option<f32>> {
    out.scores.clone()
}

fn counter(out: &RewardOutput, name: &str) -> f64 {
    out.counters[&format!("rewards/rm/{name}")]
}

#[test]
fn the_request_is_trls_arguments_with_the_token_and_headers() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    let toml_text = format!(
        r#"
[[rewards]]
type = "http"
name = "rm"
url = "{url}"
api_key_env = "{VAR}"
headers = {{ X-Team = "blue" }}
timeout = 5
"#,
        url = srv.rewards_url()
    );
    let cfg: RewardsConfig = toml::from_str(&toml_text).unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    assert!(set.has_async());

    // Plain samples, one without the `answer` column, one the service cannot score.
    let batch = vec![
        RewardInput::new("What is 2+2?", "SCORE=0.25")
            .with_ids(vec![11, 12])
            .with_field("answer", "4")
            .at_step(7),
        RewardInput::new("What is 3+3?", "no idea")
            .with_ids(vec![13])
            .with_field("answer", 6i64)
            .at_step(7),
        RewardInput::new("Say hi", "SCORE=1").at_step(7),
    ];
    let scored = set.score(&batch).unwrap();
    assert_eq!(scored.per_function[0], vec![Some(0.25), None, Some(1.0)]);
    assert!(scored.rewards[1].is_nan());
    assert_eq!(scored.metrics["rewards/rm/mean"], 0.625);
    assert_eq!(scored.metrics["rewards/rm/unscored"], 1.0);
    assert_eq!(scored.metrics["rewards/rm/requests"], 1.0);
    assert_eq!(scored.metrics["rewards/rm/retries"], 0.0);

    let stats = srv.stats();
    assert_eq!(stats.requests, 1);
    assert_eq!(
        stats.bodies[0],
        json!({
            "prompts": ["What is 2+2?", "What is 3+3?", "Say hi"],
            "completions": ["SCORE=0.25", "no idea", "SCORE=1"],
            "completion_ids": [[11, 12], [13], []],
            "trainer_state": {"global_step": 7},
            "answer": ["4", 6, null],
        })
    );
    let header = |name: &str| {
        stats.headers[0]
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("authorization"), Some(format!("Bearer {KEY}")));
    assert_eq!(header("x-team").as_deref(), Some("blue"));
    assert_eq!(header("content-type").as_deref(), Some("application/json"));

    // Conversational samples: messages, and the completion as an assistant message.
    let conv = vec![
        RewardInput::new("<rendered>", "SCORE=0.5")
            .with_messages(vec![
                Message::new("system", "Be brief."),
                Message::new("user", "2+2?"),
            ])
            .with_field("answer", "4")
            .at_step(8),
    ];
    let scored = set.score(&conv).unwrap();
    assert_eq!(scored.per_function[0], vec![Some(0.5)]);
    let body = &srv.stats().bodies[1];
    assert_eq!(
        body["prompts"],
        json!([[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]])
    );
    assert_eq!(
        body["completions"],
        json!([[{"role": "assistant", "content": "SCORE=0.5"}]])
    );
    assert_eq!(body["trainer_state"], json!({"global_step": 8}));
    assert_eq!(body["answer"], json!(["4"]));

    // An empty batch sends nothing.
    assert!(set.score(&[]).unwrap().rewards.is_empty());
    assert_eq!(srv.stats().requests, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_waits_that_long_then_succeeds() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    srv.push_faults([Fault::RateLimited {
        retry_after: Some(1.0),
    }]);
    let r = HttpReward::new("rm", &config(srv.rewards_url())).unwrap();
    let t = Instant::now();
    let out = r.score_async(&samples(3)).await.unwrap();
    let took = t.elapsed();
    assert_eq!(scores(&out), vec![Some(0.0), Some(1.0), Some(2.0)]);
    // The computed backoff is at most 20 ms: only the server's Retry-After explains a second.
    assert!(
        took >= Duration::from_millis(990) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert_eq!(counter(&out, "retries"), 1.0);
    assert_eq!(counter(&out, "requests"), 2.0);
    let arrivals = srv.stats().arrivals;
    assert_eq!(arrivals.len(), 2);
    assert!(arrivals[1] - arrivals[0] >= Duration::from_millis(990));

    // An HTTP date works too.
    srv.push_faults([Fault::RateLimitedRaw {
        retry_after: httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(2)),
    }]);
    let t = Instant::now();
    let out = r.score_async(&samples(1)).await.unwrap();
    assert_eq!(scores(&out), vec![Some(0.0)]);
    // The date has one-second resolution: between 1 and 2 s from now.
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_then_succeed() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    srv.push_faults([Fault::Status(500), Fault::Status(503), Fault::Status(408)]);
    let r = HttpReward::new("rm", &config(srv.rewards_url())).unwrap();
    let out = r.score_async(&samples(2)).await.unwrap();
    assert_eq!(scores(&out), vec![Some(0.0), Some(1.0)]);
    assert_eq!(counter(&out, "retries"), 3.0);
    assert_eq!(counter(&out, "requests"), 4.0);
    assert_eq!(srv.stats().requests, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_down_past_its_retries_fails_naming_the_url_not_the_token() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig {
        default_fault: Some(Fault::Status(500)),
        ..ServerConfig::default()
    })
    .unwrap();
    let mut c = config(srv.rewards_url());
    c.api_key_env = Some(VAR.into());
    c.max_retries = 2;
    let r = HttpReward::new("rm", &c).unwrap();
    let e = r.score_async(&samples(2)).await.unwrap_err();
    assert!(matches!(e, RewardError::Service { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&srv.rewards_url()), "{msg}");
    assert!(msg.contains("reward `rm`"), "{msg}");
    assert!(msg.contains("HTTP 500: "), "{msg}");
    assert!(msg.contains("injected failure"), "{msg}");
    assert!(msg.contains("gave up after 2 retries"), "{msg}");
    assert!(
        !msg.contains(KEY) && !format!("{e:?}").contains(KEY),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "one line: {msg}");
    assert_eq!(srv.stats().requests, 3);

    // Nothing listening: a connection error, retried, naming the URL.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/score");
    let mut c = config(url.clone());
    c.api_key_env = Some(VAR.into());
    c.max_retries = 1;
    let r = HttpReward::new("rm", &c).unwrap();
    let msg = r.score_async(&samples(1)).await.unwrap_err().to_string();
    assert!(msg.contains(&url), "{msg}");
    assert!(msg.contains("gave up after 1 retry"), "{msg}");
    assert!(msg.to_lowercase().contains("connect"), "{msg}");
    assert!(!msg.contains(KEY), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_times_out_and_is_retried() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    let mut c = config(srv.rewards_url());
    c.timeout = 0.3;
    c.max_retries = 1;
    let r = HttpReward::new("rm", &c).unwrap();

    // Once: the retry answers.
    srv.push_faults([Fault::Hang]);
    let t = Instant::now();
    let out = r.score_async(&samples(2)).await.unwrap();
    assert_eq!(scores(&out), vec![Some(0.0), Some(1.0)]);
    assert_eq!(counter(&out, "timeouts"), 1.0);
    assert_eq!(counter(&out, "retries"), 1.0);
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );

    // Always: an error after the retry.
    srv.reset_stats();
    srv.push_faults([Fault::Hang, Fault::Hang]);
    let t = Instant::now();
    let msg = r.score_async(&samples(2)).await.unwrap_err().to_string();
    let took = t.elapsed();
    assert!(msg.contains("no answer within 0.3 s (timeout)"), "{msg}");
    assert!(msg.contains("gave up after 1 retry"), "{msg}");
    assert!(msg.contains(&srv.rewards_url()), "{msg}");
    assert_eq!(srv.stats().requests, 2);
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_answers_fail_naming_the_reward_and_the_samples() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig {
        rewards: Arc::new(|r: &Value| {
            let n = r["completions"].as_array().map_or(0, Vec::len);
            if n == 3 {
                json!({"rewards": [1.0]})
            } else {
                json!({"rewards": [0.5, "high"]})
            }
        }),
        ..ServerConfig::default()
    })
    .unwrap();
    let r = HttpReward::new("rm", &config(srv.rewards_url())).unwrap();

    // Too few rewards.
    let e = r.score_async(&samples(3)).await.unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, RewardError::Service { .. }), "{e:?}");
    assert!(
        msg.contains("reward `rm`") && msg.contains("answered 1 rewards for the 3 samples 0..3"),
        "{msg}"
    );

    // Not a number: the sample's index in the step's batch (request 2 of 2, entry 1).
    let mut c = config(srv.rewards_url());
    c.batch_size = Some(2);
    let r2 = HttpReward::new("rm", &c).unwrap();
    let e = r2.score_async(&samples(4)).await.unwrap_err();
    match &e {
        RewardError::Sample { reward, index, .. } => {
            assert_eq!(reward, "rm");
            assert!(*index == 1 || *index == 3, "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("\"high\""), "{e}");

    // Not JSON at all, and a 4xx: not retried; the status and the body's first line. (A new
    // server: the request the failed batch above cancelled may still arrive at the old one.)
    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    let r = HttpReward::new("rm", &config(srv.rewards_url())).unwrap();
    srv.push_faults([Fault::Content("<html>oops</html>".into())]);
    let msg = r.score_async(&samples(1)).await.unwrap_err().to_string();
    assert!(msg.contains("is not {\"rewards\": [...]}"), "{msg}");
    assert!(msg.contains("<html>oops</html>"), "{msg}");
    srv.push_faults([Fault::Status(422)]);
    let msg = r.score_async(&samples(1)).await.unwrap_err().to_string();
    assert!(
        msg.contains("HTTP 422: ") && msg.contains("injected failure"),
        "{msg}"
    );
    assert!(!msg.contains("retries"), "{msg}");
    assert_eq!(srv.stats().requests, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrent_bounds_the_requests_in_flight() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig {
        latency: Duration::from_millis(150),
        ..ServerConfig::default()
    })
    .unwrap();
    let mut c = config(srv.rewards_url());
    c.batch_size = Some(1);
    c.max_concurrent = 3;
    let r = Arc::new(HttpReward::new("rm", &c).unwrap());
    // Two batches at once (overlapping steps) share the bound.
    let t = Instant::now();
    let batch = samples(6);
    let (a, b) = tokio::join!(r.score_async(&batch), r.score_async(&batch));
    let took = t.elapsed();
    let want: Vec<Option<f32>> = (0..6).map(|i| Some(i as f32)).collect();
    assert_eq!(scores(&a.unwrap()), want);
    assert_eq!(scores(&b.unwrap()), want);
    let stats = srv.stats();
    assert_eq!(stats.requests, 12);
    assert_eq!(stats.max_in_flight, 3);
    // 12 requests, 3 at a time, 150 ms each.
    assert!(took >= Duration::from_millis(590), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_size_splits_a_batch_into_requests_in_order() {
    key_env();
    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    let mut c = config(srv.rewards_url());
    c.batch_size = Some(3);
    let r = HttpReward::new("rm", &c).unwrap();
    let batch: Vec<RewardInput> = samples(7)
        .into_iter()
        .enumerate()
        .map(|(i, x)| x.with_field("id", i as i64))
        .collect();
    let out = r.score_async(&batch).await.unwrap();
    let want: Vec<Option<f32>> = (0..7).map(|i| Some(i as f32)).collect();
    assert_eq!(scores(&out), want);
    assert_eq!(counter(&out, "requests"), 3.0);
    let mut ids: Vec<Vec<i64>> = srv
        .stats()
        .bodies
        .iter()
        .map(|b| {
            assert_eq!(b["trainer_state"]["global_step"], 3);
            assert_eq!(
                b["prompts"].as_array().unwrap().len(),
                b["id"].as_array().unwrap().len()
            );
            b["id"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect()
        })
        .collect();
    ids.sort();
    assert_eq!(ids, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_token_never_leaks() {
    key_env();
    let logs = Captured::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    // A current-thread runtime keeps every task on this thread, under its subscriber.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    let mut c = config(srv.rewards_url());
    c.api_key_env = Some(VAR.into());
    let r = HttpReward::new("rm", &c).unwrap();

    // A 500 (logged, retried), then a server that echoes the headers back in its 401.
    srv.push_faults([Fault::Status(500), Fault::EchoHeaders(401)]);
    let e = rt.block_on(r.score_async(&samples(1))).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("HTTP 401"), "{msg}");
    assert!(msg.contains("authorization: Bearer <api_key_env>"), "{msg}");
    assert!(
        !msg.contains(KEY) && !format!("{e:?}").contains(KEY),
        "{msg}"
    );
    assert!(
        srv.stats()
            .authorizations
            .contains(&format!("Bearer {KEY}")),
        "the token was sent"
    );
    // An echoing 200 that is not an answer.
    srv.push_faults([Fault::EchoHeaders(200)]);
    let msg = rt
        .block_on(r.score_async(&samples(1)))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("is not {\"rewards\"") && !msg.contains(KEY),
        "{msg}"
    );

    let captured = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        captured.contains("retrying"),
        "logs were captured: {captured}"
    );
    assert!(!captured.contains(KEY), "the token is in the logs");
    let dumps = format!("{r:?} {c:?}")
        + &toml::to_string(&c).unwrap()
        + &serde_json::to_string(&c).unwrap();
    assert!(dumps.contains(VAR) && !dumps.contains(KEY), "{dumps}");

    // A missing variable names the field and the variable; the key as the name is refused
    // without being echoed.
    for (var, want) in [
        ("GRPO_HTTP_REWARD_TEST_UNSET", "GRPO_HTTP_REWARD_TEST_UNSET"),
        (&*format!("Bearer {KEY}"), "not the key"),
    ] {
        let cfg: RewardsConfig = toml::from_str(&format!(
            "[[rewards]]\ntype = \"http\"\nurl = \"http://127.0.0.1:1/\"\napi_key_env = \"{var}\""
        ))
        .unwrap();
        let err = cfg
            .build(&ScoringModels::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("rewards[0].api_key_env"), "{err}");
        assert!(err.contains(want) && !err.contains(KEY), "{err}");
    }
}

#[test]
fn config_errors_name_the_field() {
    key_env();
    for (extra, field) in [
        ("url = \"localhost:8000\"", "rewards[0].url"),
        ("url = \"http://h/\"\ntimeout = 0", "rewards[0].timeout"),
        (
            "url = \"http://h/\"\nbatch_size = 0",
            "rewards[0].batch_size",
        ),
        (
            "url = \"http://h/\"\nmax_concurrent = 0",
            "rewards[0].max_concurrent",
        ),
        (
            "url = \"http://h/\"\nheaders = { \"X Y\" = \"1\" }",
            "rewards[0].headers.X Y",
        ),
    ] {
        let cfg: RewardsConfig =
            toml::from_str(&format!("[[rewards]]\ntype = \"http\"\n{extra}")).unwrap();
        let err = cfg
            .build(&ScoringModels::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
    }
    let unknown = toml::from_str::<RewardsConfig>(
        "[[rewards]]\ntype = \"http\"\nurl = \"http://h/\"\ntimeout_secs = 3",
    )
    .unwrap_err()
    .to_string();
    assert!(unknown.contains("timeout_secs"), "{unknown}");
}

/// A training run whose reward service goes down after step 2 stops with a checkpoint, the
/// error naming the URL; the service saw the trainer's steps and the dataset's `answer`.
#[test]
fn a_service_down_stops_training_with_a_checkpoint() {
    use grpo_data::synth::ArithmeticConfig;
    use grpo_rollout::Arch;
    use grpo_rollout::init::{Preset, init_model_dir};
    use grpo_trainer::{self as trainer, RunOptions, config as tconfig};

    struct TakeDown<'a>(&'a LoopbackServer);
    impl grpo_trainer::Callbacks for TakeDown<'_> {
        fn on_step_end(&mut self, state: &grpo_trainer::TrainerState, _m: &grpo_trainer::Metrics) {
            if state.step == 2 {
                self.0
                    .update(|c| c.default_fault = Some(Fault::Status(503)));
            }
        }
    }

    key_env();
    let dir = tempfile::tempdir().unwrap();
    let root: &Path = dir.path();
    init_model_dir(&root.join("model"), Preset::Tiny, Arch::Qwen2, 3).unwrap();
    ArithmeticConfig {
        n: 16,
        seed: 1,
        digits: 1,
        steps: 1,
    }
    .write(&root.join("data.jsonl"))
    .unwrap();
    let srv = LoopbackServer::start(ServerConfig {
        rewards: Arc::new(|r: &Value| {
            let n = r["completions"].as_array().map_or(0, Vec::len);
            json!({"rewards": (0..n).map(|i| (i % 3) as f64 / 2.0).collect::<Vec<_>>()})
        }),
        ..ServerConfig::default()
    })
    .unwrap();
    let text = format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 4
max_completion_length = 6
[[rewards]]
type = "http"
name = "rm"
url = "{url}"
api_key_env = "{VAR}"
max_retries = 1
initial_backoff_ms = 1
max_backoff_ms = 2
[optim]
learning_rate = 1e-3
[train]
max_steps = 6
prompts_per_step = 2
log_completions = false
"#,
        out = root.join("run").display(),
        model = root.join("model").display(),
        data = root.join("data.jsonl").display(),
        url = srv.rewards_url(),
    );
    let p = root.join("run.toml");
    std::fs::write(&p, text).unwrap();
    let setup = trainer::setup(tconfig::load(&p, &[]).unwrap()).unwrap();
    let e = trainer::run(setup, &RunOptions::default(), &mut TakeDown(&srv)).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("scorer stage"), "{msg}");
    assert!(
        msg.contains(&srv.rewards_url()) && msg.contains("HTTP 503"),
        "{msg}"
    );
    assert!(!msg.contains(KEY), "{msg}");
    let ckpts = trainer::list_checkpoints(&root.join("run"));
    let (last, _) = ckpts.last().cloned().expect("a checkpoint");
    assert!(last >= 2, "last checkpoint at step {last}");

    let bodies = srv.stats().bodies;
    let first = &bodies[0];
    assert_eq!(first["trainer_state"]["global_step"], 0);
    assert_eq!(first["completions"].as_array().unwrap().len(), 8);
    assert_eq!(first["answer"].as_array().unwrap().len(), 8);
    assert_eq!(first["completion_ids"].as_array().unwrap().len(), 8);
    let steps: Vec<u64> = bodies
        .iter()
        .filter_map(|b| b["trainer_state"]["global_step"].as_u64())
        .collect();
    assert!(steps.contains(&1) && steps.contains(&2), "{steps:?}");
}

/// The first fenced block of `lang` after `heading` in the README.
fn readme_block(readme: &str, heading: &str, lang: &str) -> String {
    let from = readme.find(heading).expect("the README section");
    let open = format!("```{lang}\n");
    let start = from + readme[from..].find(&open).expect("the block") + open.len();
    let end = start + readme[start..].find("```").expect("the block's end");
    readme[start..end].to_owned()
}

/// Kills the child process when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The README's Python service and `[[rewards]]` entry, run as written (the URL's port and the
/// token's variable changed).
#[test]
fn the_readme_example_runs() {
    key_env();
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: python3 is not available");
        return;
    }
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let heading = "#### `type = \"http\"`";
    let script = readme_block(&readme, heading, "python");
    let entry = readme_block(&readme, heading, "toml");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reward_service.py");
    std::fs::write(&path, script).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _child = Child(
        std::process::Command::new("python3")
            .arg(&path)
            .env("PORT", port.to_string())
            .env("RM_API_KEY", KEY)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the service never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(entry.contains("http://127.0.0.1:8000/score") && entry.contains("\"RM_API_KEY\""));
    let entry = entry
        .replace("127.0.0.1:8000", &format!("127.0.0.1:{port}"))
        .replace("\"RM_API_KEY\"", &format!("\"{VAR}\""));
    let cfg: RewardsConfig = toml::from_str(&entry).unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    let batch = vec![
        RewardInput::new("2+2?", "<answer>4</answer>").with_field("answer", "4"),
        RewardInput::new("3+3?", "<answer>5</answer>").with_field("answer", 6i64),
        RewardInput::new("hi", "hello"),
        RewardInput::new("<rendered>", "it is 7")
            .with_messages(vec![Message::new("user", "3+4?")])
            .with_field("answer", "7"),
    ];
    let scored = set.score(&batch).unwrap();
    assert_eq!(
        scored.per_function[0],
        vec![Some(1.0), Some(0.0), None, Some(1.0)]
    );

    // A wrong token: the service's 401, not retried.
    let mut c = HttpRewardConfig::new(format!("http://127.0.0.1:{port}/score"));
    c.headers
        .insert("Authorization".into(), "Bearer nope".into());
    let r = HttpReward::new("rm", &c).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let msg = rt.block_on(r.score_async(&batch)).unwrap_err().to_string();
    assert!(
        msg.contains("HTTP 401: {\"error\": \"bad token\"}"),
        "{msg}"
    );
}
