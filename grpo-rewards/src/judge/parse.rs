//! Reading a score (and an explanation) from a judge's reply.

use regex::Regex;

use super::config::ScoreParse;
pub(crate) use crate::http::snippet;

/// What a reply said.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedScore {
    /// The score on the judge's own scale.
    pub raw: f64,
    /// The explanation, when the reply had one.
    pub explanation: Option<String>,
}

/// How to read replies, compiled from a [`super::JudgeConfig`].
#[derive(Debug, Clone)]
pub struct ScoreReader {
    pub(crate) parse: ScoreParse,
    pub(crate) score_key: String,
    pub(crate) explanation_key: String,
    pub(crate) regex: Option<Regex>,
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) range: [f32; 2],
}

fn number_of(v: &serde_json::Value) -> Option<f64> {
    match v {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
    .filter(|x: &f64| x.is_finite())
}

/// The JSON objects embedded in `text` (a ```json fence, or balanced `{...}` spans).
fn json_objects(text: &str) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(text.trim()) {
        out.push(v);
        return out;
    }
    let bytes: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == '{' {
            let mut depth = 0i32;
            let mut in_str = false;
            let mut escaped = false;
            for j in i..bytes.len() {
                let c = bytes[j];
                if in_str {
                    if escaped {
                        escaped = false;
                    } else if c == '\\' {
                        escaped = true;
                    } else if c == '"' {
                        in_str = false;
                    }
                    continue;
                }
                match c {
                    '"' => in_str = true,
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            let span: String = bytes[i..=j].iter().collect();
                            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&span) {
                                out.push(v);
                            }
                            break;
                        }
                    }
                    _ => {}
                }
            }
        }
        i += 1;
    }
    out
}

impl ScoreReader {
    /// Reads the score; `Err` says what was missing.
    pub fn read(&self, reply: &str) -> Result<ParsedScore, String> {
        match self.parse {
            ScoreParse::Json => {
                for obj in json_objects(reply) {
                    if let Some(raw) = obj.get(&self.score_key).and_then(number_of) {
                        let explanation = obj.get(&self.explanation_key).map(|e| match e {
                            serde_json::Value::String(s) => s.clone(),
                            other => other.to_string(),
                        });
                        return Ok(ParsedScore { raw, explanation });
                    }
                }
                Err(format!(
                    "no JSON object with a numeric `{}` in the reply: {}",
                    self.score_key,
                    snippet(reply)
                ))
            }
            ScoreParse::Regex => {
                let re = self.regex.as_ref().ok_or("score_regex is not set")?;
                let caps = re.captures(reply).ok_or_else(|| {
                    format!(
                        "score_regex `{}` does not match the reply: {}",
                        re.as_str(),
                        snippet(reply)
                    )
                })?;
                let m = caps
                    .name("score")
                    .or_else(|| caps.get(1))
                    .ok_or_else(|| format!("score_regex `{}` has no capture group", re.as_str()))?;
                let raw: f64 = m
                    .as_str()
                    .trim()
                    .parse()
                    .map_err(|_| format!("captured `{}` is not a number", m.as_str()))?;
                if !raw.is_finite() {
                    return Err(format!("captured `{}` is not finite", m.as_str()));
                }
                Ok(ParsedScore {
                    raw,
                    explanation: Some(reply.trim().to_owned()),
                })
            }
        }
    }

    /// Maps a raw score from `[score_min, score_max]` onto `output_range` (clamped).
    pub fn map(&self, raw: f64) -> f32 {
        let t = ((raw - self.min) / (self.max - self.min)).clamp(0.0, 1.0);
        let [lo, hi] = self.range;
        (f64::from(lo) + t * (f64::from(hi) - f64::from(lo))) as f32
    }
}
