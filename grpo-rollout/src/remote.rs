//! Generation on an OpenAI-compatible server (vLLM in production, `grpo-cli serve` in tests):
//! the same [`Completion`]s as [`crate::generate`], from `POST /v1/completions`, and weight
//! sync through vLLM's `POST /v1/load_lora_adapter` / `unload_lora_adapter`.
//!
//! Token ids come from vLLM's extensions: `return_token_ids` (a choice's `token_ids`), else
//! `return_tokens_as_token_ids` (log-prob tokens spelled `token_id:N`). A server that has
//! neither gets its text re-tokenised with our tokenizer; its log-probs are kept only when their
//! count matches the re-tokenised ids (otherwise `logprobs` is empty and the learner treats the
//! sample as on-policy). Prompts are sent as token ids, so the server never re-tokenises them.
//!
//! The recorded log-prob of a token is what the server returns: `grpo-cli serve` gives
//! `log_softmax(logits / temperature)` as local generation does; start vLLM with
//! `--logprobs-mode processed_logprobs` for the same quantity.
//!
//! Blocking API (a private current-thread tokio runtime), for the trainer's generator thread.

use std::path::Path;
use std::time::Duration;

use candle_core::{Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::generate::{Completion, FinishReason, SamplingParams};
use crate::tokenizer::Tokenizer;

/// Where the server is and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// The server's OpenAI base URL, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// Bearer token (vLLM's `--api-key`); empty = none.
    pub api_key: String,
    /// The served base model's name; empty = the first model `/v1/models` lists.
    pub model: String,
    /// Seconds one completions request may take.
    pub request_timeout: f64,
    /// Seconds a LoRA load/unload (or the first `/v1/models`) may take.
    pub sync_timeout: f64,
    /// Retries of a request that failed to connect or got 429/502/503/504 (1 s, 2 s, 4 s ...
    /// apart, or the server's `Retry-After`).
    pub max_retries: u32,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8000/v1".into(),
            api_key: String::new(),
            model: String::new(),
            request_timeout: 600.0,
            sync_timeout: 60.0,
            max_retries: 3,
        }
    }
}

/// A client of one OpenAI-compatible server.
#[derive(Debug)]
pub struct RemoteGenerator {
    cfg: RemoteConfig,
    base: String,
    http: reqwest::Client,
    rt: tokio::runtime::Runtime,
    served: String,
    adapter: Option<String>,
}

fn err(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(msg.to_string())
}

impl RemoteGenerator {
    /// Connects: `GET /v1/models` (within `sync_timeout`) and picks the base model.
    pub fn connect(cfg: RemoteConfig) -> Result<Self> {
        if !(cfg.request_timeout > 0.0 && cfg.sync_timeout > 0.0) {
            bail!("request_timeout and sync_timeout must be > 0 seconds");
        }
        let base = cfg.base_url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("base_url `{}`: expected http://HOST:PORT/v1", cfg.base_url);
        }
        let http = reqwest::Client::builder()
            .build()
            .map_err(|e| err(format!("HTTP client: {e}")))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| err(format!("tokio runtime: {e}")))?;
        let mut g = Self {
            cfg,
            base,
            http,
            rt,
            served: String::new(),
            adapter: None,
        };
        let models = g.call("GET", "/models", None, g.cfg.sync_timeout)?;
        let ids: Vec<String> = models["data"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m["id"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        g.served = if g.cfg.model.is_empty() {
            ids.first()
                .cloned()
                .ok_or_else(|| err(format!("{}/models lists no model", g.base)))?
        } else if ids.contains(&g.cfg.model) {
            g.cfg.model.clone()
        } else {
            bail!(
                "model `{}` is not served at {} (it serves: {})",
                g.cfg.model,
                g.base,
                ids.join(", ")
            );
        };
        Ok(g)
    }

    /// The served base model's name.
    pub fn served_model(&self) -> &str {
        &self.served
    }

    /// The adapter requests currently go to, if any.
    pub fn adapter(&self) -> Option<&str> {
        self.adapter.as_deref()
    }

    /// Loads the PEFT adapter in `dir` under `name` (`/v1/load_lora_adapter`), then unloads the
    /// previous one; later [`Self::generate`] calls with `use_adapter` use it.
    pub fn sync_adapter(&mut self, name: &str, dir: &Path) -> Result<()> {
        let path =
            std::fs::canonicalize(dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
        let load = || {
            self.call(
                "POST",
                "/load_lora_adapter",
                Some(json!({"lora_name": name, "lora_path": path.display().to_string()})),
                self.cfg.sync_timeout,
            )
        };
        // A name the server already has (a resumed run re-syncing its last version, say) is
        // unloaded and loaded again, so the server holds these weights.
        let loaded = match load() {
            Err(e) if e.to_string().contains("HTTP 400") && e.to_string().contains("already") => {
                self.call(
                    "POST",
                    "/unload_lora_adapter",
                    Some(json!({"lora_name": name})),
                    self.cfg.sync_timeout,
                )
                .and_then(|_| load())
            }
            other => other,
        };
        loaded.map_err(|e| err(format!("LoRA sync of `{name}` failed: {e}")))?;
        if let Some(old) = self.adapter.replace(name.to_string())
            && old != name
        {
            self.call(
                "POST",
                "/unload_lora_adapter",
                Some(json!({"lora_name": old})),
                self.cfg.sync_timeout,
            )
            .map_err(|e| err(format!("unloading LoRA `{old}` failed: {e}")))?;
        }
        Ok(())
    }

    /// `num_generations` completions per prompt, from the synced adapter (`use_adapter`) or the
    /// base model. Completions come back grouped by prompt, as [`crate::generate`]'s do.
    pub fn generate(
        &self,
        tokenizer: &Tokenizer,
        prompts: &[Vec<u32>],
        num_generations: usize,
        params: &SamplingParams,
        use_adapter: bool,
    ) -> Result<Vec<Completion>> {
        params.validate()?;
        if prompts.is_empty() || num_generations == 0 {
            return Ok(Vec::new());
        }
        let model = match (&self.adapter, use_adapter) {
            (Some(a), true) => a.clone(),
            (None, true) => bail!("no adapter synced yet"),
            _ => self.served.clone(),
        };
        let mut body = json!({
            "model": model,
            "prompt": prompts,
            "n": num_generations,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            // OpenAI and vLLM take a signed 64-bit seed; `grpo-cli serve` reads the bits back.
            "seed": params.seed as i64,
            "logprobs": 0,
            "return_tokens_as_token_ids": true,
            "return_token_ids": true,
        });
        // vLLM's sampling extensions, sent only when used (plain OpenAI servers refuse them).
        if params.top_k > 0 {
            body["top_k"] = json!(params.top_k);
        }
        if params.min_p > 0.0 {
            body["min_p"] = json!(params.min_p);
        }
        if params.repetition_penalty != 1.0 {
            body["repetition_penalty"] = json!(params.repetition_penalty);
        }
        if params.min_new_tokens > 0 {
            body["min_tokens"] = json!(params.min_new_tokens);
        }
        if !params.stop.is_empty() {
            body["stop"] = json!(params.stop);
        }
        if !params.stop_token_ids.is_empty() {
            body["stop_token_ids"] = json!(params.stop_token_ids);
        }
        if !params.logit_bias.is_empty() {
            let bias: serde_json::Map<String, Value> = params
                .logit_bias
                .iter()
                .map(|&(id, b)| (id.to_string(), json!(b)))
                .collect();
            body["logit_bias"] = Value::Object(bias);
        }
        let resp = self.call("POST", "/completions", Some(body), self.cfg.request_timeout)?;
        parse_completions(&resp, tokenizer, prompts.len(), num_generations, params)
    }

    /// One request with retries; the JSON answer (a plain-text 2xx answer becomes a string).
    fn call(&self, method: &str, path: &str, body: Option<Value>, timeout: f64) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut attempt = 0;
        loop {
            let mut req = match method {
                "GET" => self.http.get(&url),
                _ => self.http.post(&url),
            }
            .timeout(Duration::from_secs_f64(timeout));
            if !self.cfg.api_key.is_empty() {
                req = req.bearer_auth(&self.cfg.api_key);
            }
            if let Some(b) = &body {
                req = req.json(b);
            }
            let outcome = self.rt.block_on(async {
                let r = req.send().await?;
                let status = r.status();
                let retry_after = r
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<f64>().ok());
                let text = r.text().await?;
                Ok::<_, reqwest::Error>((status, retry_after, text))
            });
            let wait = Duration::from_secs(1u64 << attempt.min(5));
            match outcome {
                Ok((status, _, text)) if status.is_success() => {
                    return Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)));
                }
                Ok((status, retry_after, text)) => {
                    let retryable = matches!(status.as_u16(), 429 | 502 | 503 | 504);
                    if !retryable || attempt >= self.cfg.max_retries {
                        let msg = serde_json::from_str::<Value>(&text)
                            .ok()
                            .and_then(|v| v["error"]["message"].as_str().map(String::from))
                            .unwrap_or_else(|| text.chars().take(300).collect());
                        bail!("{method} {url}: HTTP {}: {msg}", status.as_u16());
                    }
                    std::thread::sleep(
                        retry_after.map_or(wait, |s| Duration::from_secs_f64(s.clamp(0.0, 60.0))),
                    );
                }
                Err(e) if e.is_timeout() => {
                    bail!("{method} {url}: no answer within {timeout} s (timed out)")
                }
                Err(e) => {
                    if attempt >= self.cfg.max_retries {
                        bail!("{method} {url}: {e} (is the server running?)");
                    }
                    std::thread::sleep(wait);
                }
            }
            attempt += 1;
        }
    }
}

/// Reads an OpenAI `/v1/completions` answer into completions (choice `i` is prompt `i / n`,
/// sample `i % n`, as OpenAI and vLLM order them).
pub fn parse_completions(
    resp: &Value,
    tokenizer: &Tokenizer,
    n_prompts: usize,
    n: usize,
    params: &SamplingParams,
) -> Result<Vec<Completion>> {
    let Some(choices) = resp["choices"].as_array() else {
        bail!("the answer has no `choices`: {}", snippet(resp));
    };
    if choices.len() != n_prompts * n {
        bail!(
            "the answer has {} choices, expected {} prompts × n = {n}",
            choices.len(),
            n_prompts
        );
    }
    let mut out = Vec::with_capacity(choices.len());
    for (pos, c) in choices.iter().enumerate() {
        let i = c["index"].as_u64().map_or(pos, |x| x as usize);
        if i >= n_prompts * n {
            bail!("choice index {i} is out of range");
        }
        let text = c["text"].as_str().unwrap_or_default().to_string();
        let lp = &c["logprobs"];
        let mut logprobs: Vec<f32> = lp["token_logprobs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x.as_f64().map_or(f32::NAN, |v| v as f32))
                    .collect()
            })
            .unwrap_or_default();
        let from_tokens: Option<Vec<u32>> = lp["tokens"].as_array().and_then(|a| {
            a.iter()
                .map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok())
                .collect()
        });
        let token_ids: Vec<u32> = match (c["token_ids"].as_array(), from_tokens) {
            (Some(a), _) => a
                .iter()
                .map(|x| x.as_u64().map(|v| v as u32))
                .collect::<Option<_>>()
                .ok_or_else(|| err(format!("choice {i}: `token_ids` holds a non-integer")))?,
            (None, Some(ids)) => ids,
            (None, None) => tokenizer.encode(&text, false)?,
        };
        if logprobs.len() != token_ids.len() || logprobs.iter().any(|x| !x.is_finite()) {
            logprobs.clear();
        }
        let finish_reason = match c["finish_reason"].as_str() {
            Some("length") => FinishReason::Length,
            _ => {
                let last = token_ids.last().copied();
                let is_eos = last.is_some_and(|t| {
                    tokenizer.eos_token_ids.contains(&t) || params.stop_token_ids.contains(&t)
                });
                if is_eos || params.stop.is_empty() {
                    FinishReason::Eos
                } else {
                    FinishReason::Stop
                }
            }
        };
        out.push(Completion {
            prompt_index: i / n,
            sample_index: i % n,
            token_ids,
            text,
            logprobs,
            finish_reason,
            top_logprobs: Vec::new(),
        });
    }
    out.sort_by_key(|c| (c.prompt_index, c.sample_index));
    Ok(out)
}

fn snippet(v: &Value) -> String {
    v.to_string().chars().take(300).collect()
}
