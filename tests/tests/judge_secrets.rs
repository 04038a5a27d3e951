//! The API key reaches the server and nowhere else: not the logs (captured at TRACE), not
//! `Debug`, not errors, not the saved config. Its own test binary, since it sets a variable.

use std::io::Write;
use std::sync::{Arc, Mutex};

use grpo_rewards::judge::{Judge, JudgeConfig};
use grpo_rewards::{AsyncReward, RewardError, RewardInput, RewardsConfig, ScoringModels};
use grpo_tests::loopback::{Fault, LoopbackServer, ServerConfig};

const VAR: &str = "GRPO_REWARDS_TEST_SECRET_KEY";
const KEY: &str = "sk-test-8c1e5d0f-TOPSECRET";

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
fn api_key_never_leaks() {
    #[allow(unsafe_code)]
    // SAFETY: this binary has a single test; nothing reads the environment concurrently.
    unsafe {
        std::env::set_var(VAR, KEY)
    };
    let logs = Captured::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let srv = LoopbackServer::start(ServerConfig::default()).unwrap();
    srv.push_faults([
        Fault::RateLimited {
            retry_after: Some(0.01),
        },
        Fault::Status(500),
        Fault::Malformed,
        Fault::Status(401),
    ]);
    let mut c = JudgeConfig::new(srv.base_url(), "m", "{{ completion }}");
    c.name = "secret-judge".into();
    c.api_key_env = Some(VAR.into());
    c.initial_backoff_ms = 1;
    c.max_retries = 3;
    c.max_concurrent = 1;
    let judge = Judge::new(c.clone()).unwrap();

    // A current-thread runtime keeps every task (hyper's connections too) on this thread, so
    // the thread-local subscriber sees all of their events.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let batch: Vec<RewardInput> = ["SCORE=0.5", "SCORE=0.6", "SCORE=0.7"]
        .iter()
        .map(|s| RewardInput::new("p", *s))
        .collect();
    let out = rt.block_on(judge.score_async(&batch)).unwrap();
    assert!(out.scores.iter().any(Option::is_some));
    assert!(
        out.scores.iter().any(Option::is_none),
        "the malformed body and the 401 fail"
    );

    // The key was sent where it belongs.
    assert!(
        srv.stats()
            .authorizations
            .iter()
            .any(|a| a == &format!("Bearer {KEY}"))
    );

    let captured = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        captured.contains("retrying"),
        "logs were captured: {captured}"
    );
    assert!(!captured.contains(KEY), "the key is in the logs");
    let debug = format!("{judge:?} {c:?}");
    assert!(debug.contains(VAR) && !debug.contains(KEY), "{debug}");
    let info = serde_json::to_string(&out.info).unwrap();
    assert!(!info.contains(KEY));
    let saved = toml::to_string(&c).unwrap() + &serde_json::to_string(&c).unwrap();
    assert!(saved.contains(VAR) && !saved.contains(KEY));

    // A missing variable names the variable, never a value.
    let mut missing = c.clone();
    missing.api_key_env = Some("GRPO_REWARDS_TEST_UNSET_VAR".into());
    let err = Judge::new(missing).unwrap_err();
    assert!(matches!(err, RewardError::MissingApiKey { .. }));
    assert!(
        err.to_string().contains("GRPO_REWARDS_TEST_UNSET_VAR"),
        "{err}"
    );

    // Putting the key itself into api_key_env is caught, and the message does not echo it.
    let cfg: RewardsConfig = toml::from_str(&format!(
        "[[rewards]]\ntype = \"judge\"\nbase_url = \"http://127.0.0.1:1\"\nmodel = \"m\"\ntemplate = \"t\"\napi_key_env = \"Bearer {KEY}\""
    ))
    .unwrap();
    let err = cfg
        .build(&ScoringModels::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("api_key_env") && !err.contains(KEY), "{err}");
}
