//! Preference rows (DPO): TRL's `extract_prompt` for datasets whose `chosen` and `rejected`
//! columns hold the prompt too (no prompt column).

use crate::Prompt;

/// Splits a chosen and a rejected sequence — both conversations or both strings — into the
/// prompt they share and the two completions, as TRL 1.16's `extract_prompt` does: the prompt
/// is everything before the first element (message, or character) where they differ, or
/// before the last element when one is a prefix of the other; when a space comes just before
/// that point it goes to the completions (TRL's rule, with its quirk at the very start: Python's
/// `[-1]` looks at the last character there). `None` when either is empty or their kinds differ.
///
/// ```
/// use grpo_data::{Message, Prompt, preference::extract_prompt};
/// let m = |r: &str, c: &str| Message::new(r, c);
/// let chosen = Prompt::Conversation(vec![m("user", "Sky?"), m("assistant", "Blue.")]);
/// let rejected = Prompt::Conversation(vec![m("user", "Sky?"), m("assistant", "Green.")]);
/// let (prompt, c, r) = extract_prompt(&chosen, &rejected).unwrap();
/// assert_eq!(prompt, Prompt::Conversation(vec![m("user", "Sky?")]));
/// assert_eq!(c, Prompt::Conversation(vec![m("assistant", "Blue.")]));
/// assert_eq!(r, Prompt::Conversation(vec![m("assistant", "Green.")]));
///
/// let t = |s: &str| Prompt::Text(s.into());
/// let (p, c, r) = extract_prompt(&t("Q: sky? A: blue"), &t("Q: sky? A: green")).unwrap();
/// assert_eq!((p, c, r), (t("Q: sky? A:"), t(" blue"), t(" green")));
/// ```
pub fn extract_prompt(chosen: &Prompt, rejected: &Prompt) -> Option<(Prompt, Prompt, Prompt)> {
    match (chosen, rejected) {
        (Prompt::Conversation(c), Prompt::Conversation(r)) => {
            let i = split(c, r, None)?;
            let ((p, c), (_, r)) = (at(c, i), at(r, i));
            Some((
                Prompt::Conversation(p),
                Prompt::Conversation(c),
                Prompt::Conversation(r),
            ))
        }
        (Prompt::Text(c), Prompt::Text(r)) => {
            let (c, r): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let i = split(&c, &r, Some(&' '))?;
            let ((p, c), (_, r)) = (at(&c, i), at(&r, i));
            let text = |v: Vec<char>| Prompt::Text(v.into_iter().collect());
            Some((text(p), text(c), text(r)))
        }
        _ => None,
    }
}

/// Where TRL's loop stops: the first index that differs, or the last when one is a prefix of
/// the other; one back when the element before it is `space` (at index 0, Python's `[-1]`:
/// the last element, giving −1). `None` when either is empty.
fn split<T: PartialEq>(c: &[T], r: &[T], space: Option<&T>) -> Option<i64> {
    let n = c.len().min(r.len());
    let last = n.checked_sub(1)?;
    let Some(i) = (0..n).find(|&i| c[i] != r[i]) else {
        return Some(last as i64);
    };
    let before = if i == 0 { c.last() } else { c.get(i - 1) };
    Some(match space.is_some() && before == space {
        true => i as i64 - 1,
        false => i as i64,
    })
}

/// Python's `v[:i]` and `v[i:]`, a negative `i` counting from the end.
fn at<T: Clone>(v: &[T], i: i64) -> (Vec<T>, Vec<T>) {
    let k = match usize::try_from(i) {
        Ok(i) => i.min(v.len()),
        Err(_) => v.len().saturating_sub(i.unsigned_abs() as usize),
    };
    (v[..k].to_vec(), v[k..].to_vec())
}
