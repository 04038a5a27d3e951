//! LLM judges against the loopback OpenAI-compatible server: parsing, ensembles, escalation,
//! the cache, limits, retries and failures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use grpo_rewards::judge::{
    EnsembleConfig, EnsembleMode, Judge, JudgeCache, JudgeConfig, JudgeEnsemble,
    ResponseFormatMode, ScoreParse, WeightedJudge,
};
use grpo_rewards::{AsyncReward, Message, RewardInput, RewardsConfig, ScoringModels};
use grpo_tests::loopback::{Fault, LoopbackServer, ServerConfig, last_message, score_from_prompt};
use serde_json::json;

fn server() -> LoopbackServer {
    LoopbackServer::start(ServerConfig::default()).expect("loopback server")
}

/// A judge on `server` with fast retries.
fn cfg(server: &LoopbackServer, name: &str) -> JudgeConfig {
    let mut c = JudgeConfig::new(
        server.base_url(),
        "judge-model",
        "Judge this: {{ completion }}",
    );
    c.name = name.into();
    c.initial_backoff_ms = 10;
    c.max_backoff_ms = 40;
    c.timeout_secs = 5.0;
    c
}

fn inputs(completions: &[&str]) -> Vec<RewardInput> {
    completions
        .iter()
        .map(|c| RewardInput::new("prompt", *c).with_field("answer", "42"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_scores_are_parsed_mapped_and_explained() {
    let srv = server();
    let mut c = cfg(&srv, "rubric");
    c.system_template = Some("You grade. Reference: {{ fields.answer }}".into());
    c.template = "Q: {{ prompt }} ({{ messages | length }} msgs)\nA: {{ completion }}".into();
    c.score_max = 10.0;
    c.output_range = [-1.0, 1.0];
    let judge = Judge::new(c).unwrap();
    let batch = vec![
        RewardInput::new("2+2?", "SCORE=7").with_field("answer", "4"),
        RewardInput::new("2+2?", "SCORE=3")
            .with_field("answer", "4")
            .with_messages(vec![Message::new("user", "2+2?")]),
        RewardInput::new("2+2?", "SCORE=15").with_field("answer", "4"),
    ];
    let out = judge.score_async(&batch).await.unwrap();
    let s: Vec<f32> = out.scores.iter().map(|s| s.unwrap()).collect();
    assert!(
        (s[0] - 0.4).abs() < 1e-6 && (s[1] + 0.4).abs() < 1e-6,
        "{s:?}"
    );
    assert_eq!(s[2], 1.0, "above the scale is clamped");
    let info = out.info[0].as_ref().unwrap();
    assert_eq!(info["raw_score"], json!(7.0));
    assert!(info["explanation"].as_str().unwrap().starts_with("judged"));
    assert_eq!(out.counters["judge/failures"], 0.0);

    let st = srv.stats();
    assert_eq!(st.requests, 3);
    assert_eq!(
        st.with_response_format, 3,
        "json scoring sends a JSON-schema response_format"
    );
    let body = &st.bodies[0];
    assert_eq!(body["model"], "judge-model");
    assert_eq!(body["messages"][0]["role"], "system");
    assert_eq!(body["messages"][0]["content"], "You grade. Reference: 4");
    assert_eq!(
        body["response_format"]["json_schema"]["schema"]["required"],
        json!(["score", "explanation"])
    );
    let users: Vec<String> = st.bodies.iter().map(last_message).collect();
    assert!(
        users.contains(&"Q: 2+2? (1 msgs)\nA: SCORE=3".to_owned()),
        "{users:?}"
    );
    // No `api_key_env`: no `Authorization` header at all, not an empty bearer token.
    assert!(
        st.authorizations.is_empty(),
        "no key configured: {:?}",
        st.authorizations
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regex_scores_and_schema_fallback() {
    let srv = LoopbackServer::start(ServerConfig {
        reject_response_format: true,
        reply: Arc::new(|r| {
            format!(
                "Reasoning... Final score: {}/10",
                last_message(r).len() % 11
            )
        }),
        ..ServerConfig::default()
    })
    .unwrap();
    // Regex parsing sends no response_format at all.
    let mut c = cfg(&srv, "regex");
    c.score_parse = ScoreParse::Regex;
    c.score_regex = Some(r"Final score: (?P<score>\d+)/10".into());
    c.score_max = 10.0;
    let judge = Judge::new(c).unwrap();
    // "Judge this: " is 12 chars; + "abc" = 15 → 15 % 11 = 4.
    let out = judge.score_async(&inputs(&["abc"])).await.unwrap();
    assert!((out.scores[0].unwrap() - 0.4).abs() < 1e-6);
    assert!(
        out.info[0].as_ref().unwrap()["explanation"]
            .as_str()
            .unwrap()
            .contains("Final score")
    );
    assert_eq!(srv.stats().with_response_format, 0);

    // JSON parsing in auto mode: the server refuses the schema once, the judge falls back.
    srv.update(|c| c.reply = Arc::new(score_from_prompt));
    srv.reset_stats();
    let judge = Judge::new(cfg(&srv, "auto")).unwrap();
    let out = judge
        .score_async(&inputs(&["SCORE=0.25", "SCORE=0.75"]))
        .await
        .unwrap();
    assert_eq!(out.scores, vec![Some(0.25), Some(0.75)]);
    let st = judge.stats();
    assert_eq!(st.schema_fallbacks, 1);
    assert_eq!(st.failures, 0);
    let again = judge.score_async(&inputs(&["SCORE=1"])).await.unwrap();
    assert_eq!(again.scores, vec![Some(1.0)]);
    assert_eq!(
        srv.stats().bodies.last().unwrap().get("response_format"),
        None
    );

    // Forcing the schema on such a server fails with the status, no panic.
    let mut c = cfg(&srv, "forced");
    c.response_format = ResponseFormatMode::JsonSchema;
    let judge = Judge::new(c).unwrap();
    let out = judge.score_async(&inputs(&["SCORE=1"])).await.unwrap();
    assert_eq!(out.scores, vec![None]);
    let err = out.info[0].as_ref().unwrap()["error"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(err.contains("forced") && err.contains("HTTP 400"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_ensemble_combines_judges() {
    let srv = LoopbackServer::start(ServerConfig {
        reply: Arc::new(|r| {
            let s = if r["model"] == "small" { 0.2 } else { 0.8 };
            json!({"score": s, "explanation": r["model"]}).to_string()
        }),
        ..ServerConfig::default()
    })
    .unwrap();
    let mut a = cfg(&srv, "small");
    a.model = "small".into();
    let mut b = cfg(&srv, "large");
    b.model = "large".into();
    let ens = JudgeEnsemble::new(
        EnsembleConfig {
            mode: EnsembleMode::Weighted,
            judges: vec![
                WeightedJudge {
                    weight: 1.0,
                    judge: a,
                },
                WeightedJudge {
                    weight: 3.0,
                    judge: b,
                },
            ],
            strong: None,
            escalation_std: 0.25,
        },
        None,
    )
    .unwrap();
    let out = ens.score_async(&inputs(&["x", "y"])).await.unwrap();
    for s in &out.scores {
        assert!((s.unwrap() - (0.2 + 3.0 * 0.8) / 4.0).abs() < 1e-6);
    }
    let info = out.info[0].as_ref().unwrap();
    assert_eq!(
        info["judges"]["small"]["score"]
            .as_f64()
            .map(|v| (v * 100.0).round()),
        Some(20.0)
    );
    assert_eq!(info["judges"]["large"]["explanation"], "large");

    // One judge failing: the mean of the others.
    srv.push_faults([Fault::Status(401)]);
    let out = ens.score_async(&inputs(&["z"])).await.unwrap();
    let s = out.scores[0].unwrap();
    assert!((s - 0.2).abs() < 1e-6 || (s - 0.8).abs() < 1e-6, "{s}");
    assert_eq!(out.counters["judge/failures"], 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escalation_asks_the_strong_judge_only_on_disagreement() {
    let srv = LoopbackServer::start(ServerConfig {
        reply: Arc::new(|r| {
            let text = last_message(r);
            let s = match r["model"].as_str() {
                Some("cheap-1") => 0.1,
                Some("cheap-2") if text.contains("disagree") => 0.9,
                Some("cheap-2") => 0.2,
                _ => 0.5,
            };
            json!({"score": s, "explanation": "ok"}).to_string()
        }),
        ..ServerConfig::default()
    })
    .unwrap();
    let judge = |name: &str| {
        let mut c = cfg(&srv, name);
        c.model = name.into();
        Arc::new(Judge::new(c).unwrap())
    };
    let ens = JudgeEnsemble::escalating(
        vec![judge("cheap-1"), judge("cheap-2")],
        judge("strong"),
        0.25,
    );
    let out = ens
        .score_async(&inputs(&["we agree", "we disagree"]))
        .await
        .unwrap();
    assert!(
        (out.scores[0].unwrap() - 0.15).abs() < 1e-6,
        "cheap mean when they agree"
    );
    assert_eq!(out.scores[1], Some(0.5), "the strong judge decides");
    let i0 = out.info[0].as_ref().unwrap();
    let i1 = out.info[1].as_ref().unwrap();
    assert_eq!(i0["escalated"], false);
    assert_eq!(i1["escalated"], true);
    assert!((i1["cheap_std"].as_f64().unwrap() - 0.4).abs() < 1e-6);
    assert_eq!(i1["strong"]["score"], json!(0.5));
    assert_eq!(out.counters["judge/escalations"], 1.0);
    let strong_calls = srv
        .stats()
        .bodies
        .iter()
        .filter(|b| b["model"] == "strong")
        .count();
    assert_eq!(strong_calls, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_hits_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache").join("judge.sqlite");
    let srv = server();
    let batch = inputs(&["SCORE=0.1", "SCORE=0.2", "SCORE=0.3"]);
    {
        let mut c = cfg(&srv, "cached");
        c.cache_path = Some(path.clone());
        let judge = Judge::new(c).unwrap();
        let out = judge.score_async(&batch).await.unwrap();
        assert_eq!(out.counters["judge/cache_hits"], 0.0);
        assert_eq!(judge.stats().cache_misses, 3);
    }
    assert_eq!(srv.stats().requests, 3);
    // A new judge (a new process, as far as the cache knows) on the same file.
    let mut c = cfg(&srv, "cached");
    c.cache_path = Some(path.clone());
    let judge = Judge::new(c.clone()).unwrap();
    let out = judge.score_async(&batch).await.unwrap();
    assert_eq!(out.scores, vec![Some(0.1), Some(0.2), Some(0.3)]);
    assert_eq!(out.counters["judge/cache_hits"], 3.0);
    assert_eq!(out.info[0].as_ref().unwrap()["cached"], true);
    assert_eq!(srv.stats().requests, 3, "no new request");
    let cache = judge.cache().unwrap();
    assert_eq!(
        (cache.hits(), cache.misses(), cache.len().unwrap()),
        (3, 0, 3)
    );

    // A different template or sampling parameter is a different key.
    let mut other = c.clone();
    other.temperature = 0.7;
    let judge = Judge::new(other).unwrap();
    judge.score_async(&batch[..1]).await.unwrap();
    assert_eq!(srv.stats().requests, 4);
    let cache = JudgeCache::open(&path).unwrap();
    assert_eq!(cache.len().unwrap(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_is_held() {
    let srv = server();
    let mut c = cfg(&srv, "limited");
    c.requests_per_minute = Some(1200); // 20 requests/s
    c.burst = Some(1);
    c.max_concurrent = 16;
    let judge = Judge::new(c).unwrap();
    let batch: Vec<RewardInput> = (0..31)
        .map(|i| RewardInput::new("p", format!("SCORE=0.{i}")))
        .collect();
    let out = judge.score_async(&batch).await.unwrap();
    assert!(out.scores.iter().all(Option::is_some));
    let arrivals = srv.stats().arrivals;
    assert_eq!(arrivals.len(), 31);
    let span = arrivals[30].duration_since(arrivals[0]).as_secs_f64();
    let rate = 30.0 / span;
    assert!(
        rate <= 20.0 * 1.1,
        "measured {rate:.1} requests/s for a limit of 20/s"
    );
    assert!(rate >= 20.0 * 0.7, "limiter far too slow: {rate:.1}/s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_rate_limit_is_held() {
    let srv = server();
    let mut c = cfg(&srv, "tpm");
    c.max_tokens = 100;
    // Each request is estimated at 100 + 19/4 + 4 = 108 tokens. 12,000 tokens/min = 200/s with a
    // burst of max_tokens + 256 = 356: three requests at once, then one every 0.54 s.
    c.tokens_per_minute = Some(12_000);
    let judge = Judge::new(c).unwrap();
    let t0 = Instant::now();
    let out = judge.score_async(&inputs(&["SCORE=1"; 6])).await.unwrap();
    assert!(out.scores.iter().all(Option::is_some));
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(1200) && took < Duration::from_secs(4),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_cap_is_held() {
    let srv = LoopbackServer::start(ServerConfig {
        latency: Duration::from_millis(80),
        ..ServerConfig::default()
    })
    .unwrap();
    let mut c = cfg(&srv, "capped");
    c.max_concurrent = 4;
    let judge = Judge::new(c).unwrap();
    let batch: Vec<RewardInput> = (0..24)
        .map(|i| RewardInput::new("p", format!("{i}")))
        .collect();
    let t0 = Instant::now();
    judge.score_async(&batch).await.unwrap();
    let st = srv.stats();
    assert_eq!(
        st.max_in_flight, 4,
        "server saw {} at once",
        st.max_in_flight
    );
    assert!(judge.stats().peak_in_flight <= 4);
    assert!(
        t0.elapsed() >= Duration::from_millis(6 * 80),
        "{:?}",
        t0.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_recover_from_transient_failures() {
    let srv = server();
    srv.push_faults([
        Fault::RateLimited {
            retry_after: Some(0.3),
        },
        Fault::Status(500),
        Fault::Status(503),
        Fault::Status(408),
    ]);
    let judge = Judge::new(cfg(&srv, "retrying")).unwrap();
    let t0 = Instant::now();
    let out = judge.score_async(&inputs(&["SCORE=0.9"])).await.unwrap();
    assert_eq!(out.scores, vec![Some(0.9)]);
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "Retry-After honoured: {:?}",
        t0.elapsed()
    );
    assert_eq!(out.counters["judge/retries"], 4.0);
    assert_eq!(out.counters["judge/failures"], 0.0);
    assert_eq!(srv.stats().requests, 5);

    // A hang is cut by the timeout and retried.
    srv.push_faults([Fault::Hang]);
    let mut c = cfg(&srv, "hang");
    c.timeout_secs = 0.3;
    let judge = Judge::new(c).unwrap();
    let out = judge.score_async(&inputs(&["SCORE=0.5"])).await.unwrap();
    assert_eq!(out.scores, vec![Some(0.5)]);
    assert_eq!(out.counters["judge/retries"], 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failures_give_none_and_are_counted() {
    let srv = LoopbackServer::start(ServerConfig {
        default_fault: Some(Fault::Status(500)),
        ..ServerConfig::default()
    })
    .unwrap();
    let mut c = cfg(&srv, "down");
    c.max_retries = 2;
    let judge = Judge::new(c).unwrap();
    let out = judge.score_async(&inputs(&["a", "b"])).await.unwrap();
    assert_eq!(out.scores, vec![None, None]);
    assert_eq!(out.counters["judge/failures"], 2.0);
    assert_eq!(srv.stats().requests, 6, "1 + max_retries attempts each");
    let err = out.info[0].as_ref().unwrap()["error"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        err.contains("judge `down`") && err.contains("HTTP 500"),
        "{err}"
    );

    // Not retried: 400, malformed bodies, replies without a score.
    srv.update(|c| c.default_fault = None);
    srv.reset_stats();
    srv.push_faults([
        Fault::Status(400),
        Fault::Malformed,
        Fault::Content("I refuse to grade".into()),
    ]);
    let mut c = cfg(&srv, "bad");
    c.response_format = ResponseFormatMode::None;
    c.max_concurrent = 1;
    let judge = Judge::new(c).unwrap();
    let out = judge.score_async(&inputs(&["1", "2", "3"])).await.unwrap();
    assert_eq!(out.scores, vec![None, None, None]);
    assert_eq!(judge.stats().failures, 3);
    assert_eq!(srv.stats().requests, 3);

    // Hangs past every retry; connection refused.
    let mut c = cfg(&srv, "hung");
    c.timeout_secs = 0.2;
    c.max_retries = 1;
    srv.update(|c| c.default_fault = Some(Fault::Hang));
    let judge = Judge::new(c).unwrap();
    let out = judge.score_async(&inputs(&["x"])).await.unwrap();
    assert_eq!(out.scores, vec![None]);
    assert!(
        out.info[0].as_ref().unwrap()["error"]
            .as_str()
            .unwrap()
            .contains("timeout_secs")
    );

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut c = JudgeConfig::new(
        format!("http://127.0.0.1:{port}/v1"),
        "m",
        "{{ completion }}",
    );
    c.max_retries = 1;
    c.initial_backoff_ms = 5;
    c.name = "refused".into();
    let judge = Judge::new(c).unwrap();
    let out = judge.score_async(&inputs(&["x"])).await.unwrap();
    assert_eq!(out.scores, vec![None]);
    assert_eq!(judge.stats().retries, 1);
    assert_eq!(judge.stats().failures, 1);
}

#[test]
fn reward_set_drives_judges_from_sync_code() {
    let srv = LoopbackServer::start(ServerConfig {
        reply: Arc::new(|r| {
            if last_message(r).contains("unjudgeable") {
                "no score here".to_owned()
            } else {
                score_from_prompt(r)
            }
        }),
        ..ServerConfig::default()
    })
    .unwrap();
    let text = format!(
        r#"
        [[rewards]]
        type = "accuracy"
        [[rewards]]
        type = "judge"
        name = "style"
        weight = 0.5
        base_url = "{}"
        model = "m"
        template = "{{{{ completion }}}}"
        max_retries = 1
        initial_backoff_ms = 1
        "#,
        srv.base_url()
    );
    let cfg: RewardsConfig = toml::from_str(&text).unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    let batch = vec![
        RewardInput::new("q", "42 SCORE=0.4").with_field("answer", "0.4"),
        RewardInput::new("q", "unjudgeable 1").with_field("answer", "1"),
        RewardInput::new("q", "SCORE=0.8").with_field("answer", "1"),
    ];
    let s = set.score(&batch).unwrap();
    assert_eq!(s.per_function[0], vec![Some(1.0), Some(1.0), Some(0.0)]);
    assert_eq!(s.per_function[1], vec![Some(0.4), None, Some(0.8)]);
    assert_eq!(s.metrics["judge/failures"], 1.0);
    let want = [1.0 + 0.2, 1.0, 0.4];
    for (r, w) in s.rewards.iter().zip(want) {
        assert!((r - w).abs() < 1e-6, "{:?}", s.rewards);
    }
    assert!((s.metrics["rewards/style/mean"] - 0.6).abs() < 1e-6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_as_an_http_date_is_honoured() {
    let srv = server();
    // IMF-fixdate has one-second resolution: 2 s ahead means a wait in (1, 2] s, far above
    // the judge's own backoff (10–40 ms here).
    let at = std::time::SystemTime::now() + Duration::from_secs(2);
    srv.push_faults([Fault::RateLimitedRaw {
        retry_after: httpdate::fmt_http_date(at),
    }]);
    let judge = Judge::new(cfg(&srv, "dated")).unwrap();
    let t0 = Instant::now();
    let out = judge.score_async(&inputs(&["SCORE=0.6"])).await.unwrap();
    let waited = t0.elapsed();
    assert_eq!(out.scores, vec![Some(0.6)]);
    assert_eq!(out.counters["judge/retries"], 1.0);
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
        "Retry-After date honoured: {waited:?}"
    );

    // A date in the past means "retry now"; an unparsable value falls back to the backoff.
    srv.push_faults([
        Fault::RateLimitedRaw {
            retry_after: "Wed, 21 Oct 2015 07:28:00 GMT".into(),
        },
        Fault::RateLimitedRaw {
            retry_after: "soon".into(),
        },
    ]);
    let t0 = Instant::now();
    let out = judge.score_async(&inputs(&["SCORE=0.2"])).await.unwrap();
    assert_eq!(out.scores, vec![Some(0.2)]);
    assert_eq!(out.counters["judge/retries"], 2.0);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());

    // The date replaces the computed wait also when that would be longer: a backoff of at
    // least 10 s (equal jitter on d = 20 s), and the server says 2 s.
    let mut c = cfg(&srv, "patient");
    c.initial_backoff_ms = 20_000;
    c.max_backoff_ms = 20_000;
    let judge = Judge::new(c).unwrap();
    let at = std::time::SystemTime::now() + Duration::from_secs(2);
    srv.push_faults([Fault::RateLimitedRaw {
        retry_after: httpdate::fmt_http_date(at),
    }]);
    let t0 = Instant::now();
    let out = judge.score_async(&inputs(&["SCORE=0.7"])).await.unwrap();
    let waited = t0.elapsed();
    assert_eq!(out.scores, vec![Some(0.7)]);
    assert_eq!(out.counters["judge/retries"], 1.0);
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "Retry-After date, not the 10-20 s backoff: {waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_fails_for_one_sample_gives_it_none() {
    let srv = server();
    let mut c = cfg(&srv, "strict");
    // `fields.answer` is missing in the second sample; the strict `round` filter fails on the
    // third's text value.
    c.template = "ref {{ fields.answer }} ({{ fields.n | round }}): {{ completion }}".into();
    let judge = Judge::new(c).unwrap();
    let batch = vec![
        RewardInput::new("q", "SCORE=0.5")
            .with_field("answer", "4")
            .with_field("n", 2.0),
        RewardInput::new("q", "SCORE=0.7").with_field("n", 2.0),
        RewardInput::new("q", "SCORE=0.9")
            .with_field("answer", "4")
            .with_field("n", "two"),
    ];
    let out = judge.score_async(&batch).await.unwrap();
    assert_eq!(out.scores, vec![Some(0.5), None, None]);
    assert_eq!(out.counters["judge/failures"], 2.0);
    let err = out.info[1].as_ref().unwrap()["error"].as_str().unwrap();
    assert!(err.contains("template"), "{err}");
    assert_eq!(
        srv.stats().requests,
        1,
        "no request for unrenderable samples"
    );
    assert_eq!(judge.stats().failures, 2);

    // Templates that do not compile, or use an unknown variable, stay config-time errors.
    for (template, needle) in [
        ("{{ completion ", "template"),
        ("{{ completoin }}", "`completoin`"),
    ] {
        let mut c = cfg(&srv, "broken");
        c.template = template.into();
        let e = Judge::new(c).unwrap_err().to_string();
        assert!(e.contains("judge `broken`") && e.contains(needle), "{e}");
    }
    // Loop variables, globals and filters are not mistaken for unknown variables.
    let mut c = cfg(&srv, "loops");
    c.template = "{% for m in messages %}{{ loop.index }}{{ m.content }}{% endfor %}\
                  {% for i in range(2) %}{{ i }}{% endfor %}{{ completion | upper }}"
        .into();
    Judge::new(c).unwrap();
}
