//! `grpo_data::preference::extract_prompt` against TRL's own `extract_prompt`.
#![allow(clippy::unwrap_used, missing_docs)]

use grpo_data::preference::extract_prompt;
use grpo_data::{Message, Prompt};

/// A reference value: a string, or a conversation of (role, content).
#[derive(Debug, Clone, Copy)]
pub enum V {
    S(&'static str),
    M(&'static [(&'static str, &'static str)]),
}
use V::{M, S};

#[path = "../data/extract_prompt_reference.rs"]
#[allow(clippy::type_complexity)]
mod reference;

fn prompt(v: V) -> Prompt {
    match v {
        S(s) => Prompt::Text(s.to_string()),
        M(m) => Prompt::Conversation(m.iter().map(|(r, c)| Message::new(*r, *c)).collect()),
    }
}

#[test]
fn splits_as_trl_does() {
    assert!(reference::CASES.len() > 40);
    for (k, &(c, r, p, cc, rc)) in reference::CASES.iter().enumerate() {
        let got = extract_prompt(&prompt(c), &prompt(r)).unwrap();
        assert_eq!(
            got,
            (prompt(p), prompt(cc), prompt(rc)),
            "case {k}: {c:?} / {r:?}"
        );
    }
}

#[test]
fn empty_or_mixed_rows_have_no_split() {
    let t = |s: &str| Prompt::Text(s.into());
    assert!(extract_prompt(&t(""), &t("a")).is_none());
    assert!(extract_prompt(&t("a"), &Prompt::Conversation(vec![])).is_none());
}
