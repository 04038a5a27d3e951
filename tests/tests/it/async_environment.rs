//! An environment that talks to the outside: a guess-the-number sandbox behind a real HTTP
//! server on loopback, called by an `AsyncEnvironment` with a real HTTP client, every episode's
//! request of a turn in flight at once, run by `env::Blocking` inside multi-turn generation —
//! from a plain thread and from inside a tokio runtime.
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Result};
use grpo_rollout::env::{AsyncEnvironment, Blocking, Environment, EnvironmentReturn};
use grpo_rollout::episode::{EpisodeEnd, EpisodeParams, EpisodePrompt, generate_episodes};
use grpo_rollout::generate::SamplingParams;
use grpo_rollout::init::{Preset, preset_config, random_weights, train_tokenizer};
use grpo_rollout::{Arch, ChatMessage, Tokenizer, Transformer};
use grpo_tests::loopback::{LoopbackServer, ServerConfig};
use serde_json::{Value, json};

/// The sandbox's verdict on a `{"guess": g, "target": t}` body, as `{"rewards": [..],
/// "verdict": ..}` (the loopback server's `/rewards` route answers what this returns).
fn verdict(body: &Value) -> Value {
    let t = body["target"].as_i64().unwrap_or(0);
    let v = match body["guess"].as_i64() {
        None => "no number",
        Some(g) if g < t => "higher",
        Some(g) if g > t => "lower",
        Some(_) => "right",
    };
    json!({ "rewards": [if v == "right" { 1.0 } else { 0.0 }], "verdict": v })
}

/// The first run of digits in `text`.
fn first_int(text: &str) -> Option<i64> {
    let digits: String = text
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Asks the sandbox about each episode's last turn, all at once.
struct RemoteGuess {
    url: String,
    client: reqwest::Client,
}

impl AsyncEnvironment for RemoteGuess {
    fn name(&self) -> &str {
        "remote-guess"
    }

    async fn step(
        &self,
        logs: &[&[ChatMessage]],
        metadata: &[&Value],
    ) -> Result<EnvironmentReturn> {
        let calls = logs.iter().zip(metadata).map(|(log, meta)| {
            let guess = log.last().and_then(|m| first_int(&m.content));
            let body = json!({ "guess": guess, "target": meta["target"] });
            async move {
                let r = self
                    .client
                    .post(&self.url)
                    .json(&body)
                    .send()
                    .await
                    .map_err(candle_core::Error::wrap)?;
                r.json::<Value>().await.map_err(candle_core::Error::wrap)
            }
        });
        let answers = futures_util::future::try_join_all(calls).await?;
        let mut out = EnvironmentReturn::empty(logs.len());
        for (i, a) in answers.iter().enumerate() {
            let v = a["verdict"].as_str().unwrap_or("?");
            out.observations[i] = Some(ChatMessage::new("user", format!("Sandbox: {v}.")));
            out.rewards[i] = a["rewards"][0].as_f64().unwrap_or(0.0) as f32;
            out.terminateds[i] = v == "right";
            out.metadata[i] = metadata[i].clone();
        }
        Ok(out)
    }
}

fn tiny() -> (Transformer, Tokenizer) {
    let tok = train_tokenizer(400).unwrap();
    let cfg = preset_config(
        Preset::Tiny,
        Arch::Qwen2,
        tok.vocab_size(),
        tok.eos_token_ids[0],
        tok.pad_token_id,
    );
    let m = random_weights(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    (m.detached(), tok)
}

fn prompts(tok: &Tokenizer) -> Vec<EpisodePrompt> {
    [3, 71]
        .iter()
        .map(|t| {
            EpisodePrompt::from_messages(
                tok,
                vec![ChatMessage::new("user", "Guess my number.")],
                json!({ "target": t }),
            )
            .unwrap()
        })
        .collect()
}

fn params() -> EpisodeParams {
    EpisodeParams {
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        },
        max_turns: 3,
        max_tokens_per_turn: 6,
        max_total_tokens: 200,
    }
}

#[test]
fn an_async_environment_sends_a_turns_requests_at_once_over_http() {
    let server = LoopbackServer::start(ServerConfig {
        latency: Duration::from_millis(150),
        rewards: Arc::new(verdict),
        ..Default::default()
    })
    .unwrap();
    let env = Blocking::new(RemoteGuess {
        url: server.rewards_url(),
        client: reqwest::Client::new(),
    })
    .unwrap();
    assert_eq!(Environment::name(&env), "remote-guess");
    let (model, tok) = tiny();
    let ps = prompts(&tok);
    let episodes = generate_episodes(&model, &tok, &env, &ps, 4, &params()).unwrap();
    assert_eq!(episodes.len(), 8);
    let stats = server.stats();
    // One request per model turn, and the sandbox's verdicts are what the model saw.
    let turns: usize = episodes.iter().map(|e| e.turns.len()).sum();
    assert_eq!(stats.requests as usize, turns);
    // The first turn's 8 requests were in flight together (150 ms each: one after another
    // they would take 1.2 s).
    assert_eq!(stats.max_in_flight, 8, "{stats:?}");
    for (i, ep) in episodes.iter().enumerate() {
        let target = [3, 71][i / 4];
        // Every assistant turn but a last unanswered one is followed by the sandbox's verdict
        // on it, as the server computed it.
        let msgs = &ep.messages[1..];
        for pair in msgs.windows(2).filter(|w| w[0].role == "assistant") {
            let want = verdict(&json!({ "guess": first_int(&pair[0].content), "target": target }));
            assert_eq!(pair[1].role, "user");
            assert_eq!(
                pair[1].content,
                format!("Sandbox: {}.", want["verdict"].as_str().unwrap())
            );
        }
        match ep.end {
            EpisodeEnd::Terminated => assert_eq!(ep.turns.last().unwrap().reward, 1.0),
            _ => assert!(ep.turns.iter().all(|t| t.reward == 0.0)),
        }
    }
    let asked = |t: i64| stats.bodies.iter().filter(|b| b["target"] == t).count();
    let turns_of =
        |r: std::ops::Range<usize>| -> usize { episodes[r].iter().map(|e| e.turns.len()).sum() };
    assert_eq!(asked(3), turns_of(0..4));
    assert_eq!(asked(71), turns_of(4..8));

    // The same call from inside a tokio runtime (an async caller) does not nest runtimes, and
    // the same seed gives the same episodes.
    server.reset_stats();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let again = rt.block_on(async { generate_episodes(&model, &tok, &env, &ps, 4, &params()) });
    let again = again.unwrap();
    assert_eq!(
        again.iter().map(|e| &e.token_ids).collect::<Vec<_>>(),
        episodes.iter().map(|e| &e.token_ids).collect::<Vec<_>>()
    );
    assert_eq!(server.stats().requests as usize, turns);
}

#[test]
fn a_failing_http_sandbox_is_one_error_naming_the_environment() {
    let server = LoopbackServer::start(ServerConfig::default()).unwrap();
    let url = format!("{}-nowhere", server.rewards_url());
    drop(server);
    let env = Blocking::new(RemoteGuess {
        url,
        client: reqwest::Client::new(),
    })
    .unwrap();
    let (model, tok) = tiny();
    let e = generate_episodes(&model, &tok, &env, &prompts(&tok), 2, &params())
        .unwrap_err()
        .to_string();
    // candle appends a backtrace under RUST_BACKTRACE; the message is the first line.
    let line = e.lines().next().unwrap();
    assert!(
        line.contains("environment `remote-guess` failed at turn 1")
            && line.contains("error sending request"),
        "{e}"
    );
}
