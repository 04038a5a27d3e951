//! The retry policy: exponential backoff with equal jitter (backon), a retry budget, and the
//! server's `Retry-After` in place of the computed wait.

use std::future::Future;
use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};

/// The longest wait a server can ask for with `Retry-After` or `retry-after-ms` and get: 10
/// minutes. A longer ask is cut to this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);

/// What a failed attempt says about retrying it.
pub trait RetryDecision {
    /// Whether another attempt may succeed (e.g. HTTP 429, 5xx, a connection error).
    fn retryable(&self) -> bool;
    /// The wait the server asked for (its `Retry-After`), which replaces the computed backoff.
    fn retry_after(&self) -> Option<Duration> {
        None
    }
}

/// Why one HTTP attempt failed, and whether to try again: the [`RetryDecision`] of the
/// project's clients (the `http` reward, grpo-rollout's ORS client).
#[derive(Debug, Clone, PartialEq)]
pub struct FailedAttempt {
    /// One line for the user.
    pub message: String,
    /// The HTTP status, when the server answered.
    pub status: Option<u16>,
    /// Whether another attempt may succeed.
    pub retryable: bool,
    /// The wait the server asked for.
    pub retry_after: Option<Duration>,
}

impl RetryDecision for FailedAttempt {
    fn retryable(&self) -> bool {
        self.retryable
    }
    fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

/// HTTP statuses worth another attempt: 408 (request timeout), 409 (conflict), 429 (rate
/// limited) and every 5xx.
pub fn retryable_status(status: u16) -> bool {
    matches!(status, 408 | 409 | 429) || status >= 500
}

/// One retry policy for every HTTP client of the project (the judges, grpo-rollout's `remote`).
///
/// An attempt that fails with a retryable error is retried at most `max_retries` times. Before
/// retry `k` (0 for the first), with `d = min(initial_backoff · 2^k, max_backoff)`, it waits a
/// uniformly random time between `d/2` and `d` ("equal jitter": half the wait fixed, half
/// random), unless the failed response carried `Retry-After` (or `retry-after-ms`): then it
/// waits exactly what the server asked, up to [`MAX_RETRY_AFTER`], even above `max_backoff`.
///
/// Built on backon's [`ExponentialBuilder`] (factor 2, jitter on): backon waits a base `b`
/// plus a uniform random fraction of `b`, in `[b, 2b)`, with `b` doubling from its minimum up to
/// its maximum; this policy gives it `initial_backoff / 2` and `max_backoff / 2` as those,
/// which is the equal jitter above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// `d` of the first retry.
    pub initial_backoff: Duration,
    /// The largest `d` (the cap of the computed waits; not of a server's `Retry-After`).
    pub max_backoff: Duration,
}

impl RetryPolicy {
    /// A policy; `initial_backoff` above `max_backoff` is taken as `max_backoff`.
    pub const fn new(max_retries: u32, initial_backoff: Duration, max_backoff: Duration) -> Self {
        Self {
            max_retries,
            initial_backoff,
            max_backoff,
        }
    }

    /// The backon builder of the computed waits (see the type's doc).
    pub fn backoff(&self) -> ExponentialBuilder {
        let initial = self.initial_backoff.min(self.max_backoff);
        ExponentialBuilder::new()
            .with_factor(2.0)
            .with_min_delay(initial / 2)
            .with_max_delay(self.max_backoff / 2)
            .with_jitter()
            .with_max_times(self.max_retries as usize)
    }

    /// The computed waits of one request, one per retry (`max_retries` of them; random).
    pub fn delays(&self) -> impl Iterator<Item = Duration> + use<> {
        self.backoff().build()
    }

    /// Runs `attempt` until it succeeds, fails with an error that is not
    /// [`RetryDecision::retryable`], or has been retried `max_retries` times (then the last
    /// error is returned). `notify` sees each error that is retried and the wait before the
    /// retry. The waits are tokio sleeps.
    pub async fn retry<T, E, F, Fut, N>(&self, attempt: F, notify: N) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: RetryDecision,
        N: FnMut(&E, Duration),
    {
        attempt
            .retry(self.backoff())
            .when(E::retryable)
            .adjust(|e: &E, computed| next_wait(computed, e.retry_after()))
            .notify(notify)
            .await
    }
}

/// The wait before the next retry: `None` when the retries are spent (`computed` is `None`),
/// else the server's `retry_after` (capped at [`MAX_RETRY_AFTER`]) when it gave one, else the
/// computed backoff.
pub fn next_wait(computed: Option<Duration>, retry_after: Option<Duration>) -> Option<Duration> {
    computed.map(|d| retry_after.map_or(d, |ra| ra.min(MAX_RETRY_AFTER)))
}

/// A `Retry-After` header value as a wait from now: delta-seconds (`"120"`; a decimal such as
/// `"1.5"` is accepted too) or an HTTP date (RFC 9110: IMF-fixdate, and the obsolete RFC 850
/// and asctime forms), where a date in the past means no wait. Capped at [`MAX_RETRY_AFTER`];
/// `None` for anything else (a negative number, garbage).
pub fn retry_after(value: &str) -> Option<Duration> {
    retry_after_at(value, SystemTime::now())
}

/// [`retry_after`] with the current time given (dates are relative to it).
pub fn retry_after_at(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0)
            .then(|| Duration::from_secs_f64(secs.min(MAX_RETRY_AFTER.as_secs_f64())));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let wait = at.duration_since(now).unwrap_or(Duration::ZERO);
    Some(wait.min(MAX_RETRY_AFTER))
}

/// OpenAI's `retry-after-ms` header value (milliseconds, integer or decimal), capped at
/// [`MAX_RETRY_AFTER`].
pub fn retry_after_ms(value: &str) -> Option<Duration> {
    let ms = value.trim().parse::<f64>().ok()?;
    (ms.is_finite() && ms >= 0.0)
        .then(|| Duration::from_secs_f64((ms / 1000.0).min(MAX_RETRY_AFTER.as_secs_f64())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::{Instant, UNIX_EPOCH};

    #[test]
    fn retry_after_seconds_dates_past_dates_and_garbage() {
        // 2015-10-21T07:28:00Z
        let now = UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        let ra = |v: &str| retry_after_at(v, now);
        assert_eq!(ra("3"), Some(Duration::from_secs(3)));
        assert_eq!(ra("0"), Some(Duration::ZERO));
        assert_eq!(ra(" 1.5 "), Some(Duration::from_millis(1500)));
        // A date in the future: the time until it.
        assert_eq!(
            ra("Wed, 21 Oct 2015 07:28:30 GMT"),
            Some(Duration::from_secs(30))
        );
        // RFC 850 and asctime forms, which RFC 9110 says to accept.
        assert_eq!(
            ra("Wednesday, 21-Oct-15 07:28:05 GMT"),
            Some(Duration::from_secs(5))
        );
        assert_eq!(ra("Wed Oct 21 07:28:07 2015"), Some(Duration::from_secs(7)));
        // A date in the past: retry now.
        assert_eq!(ra("Wed, 21 Oct 2015 07:00:00 GMT"), Some(Duration::ZERO));
        // Capped.
        assert_eq!(ra("Thu, 22 Oct 2015 07:28:00 GMT"), Some(MAX_RETRY_AFTER));
        assert_eq!(ra("86400"), Some(MAX_RETRY_AFTER));
        // Garbage.
        for bad in [
            "-1",
            "tomorrow",
            "",
            "NaN",
            "inf",
            "Wed, 32 Oct 2015 07:28:00 GMT",
        ] {
            assert_eq!(ra(bad), None, "{bad:?}");
        }
        // Relative to the real clock.
        let soon = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(5));
        let w = retry_after(&soon).unwrap();
        assert!(
            w > Duration::from_secs(3) && w <= Duration::from_secs(5),
            "{w:?}"
        );
        assert_eq!(retry_after_ms("250"), Some(Duration::from_millis(250)));
        assert_eq!(retry_after_ms("1e9"), Some(MAX_RETRY_AFTER));
        assert_eq!(retry_after_ms("soon"), None);
    }

    #[test]
    fn delays_are_equal_jitter_doubling_to_the_cap() {
        let p = RetryPolicy::new(6, Duration::from_millis(500), Duration::from_secs(4));
        let eps = Duration::from_micros(10);
        let mut first = Vec::new();
        for _ in 0..200 {
            let waits: Vec<Duration> = p.delays().collect();
            assert_eq!(waits.len(), 6);
            for (k, w) in waits.iter().enumerate() {
                let d = (Duration::from_millis(500) * (1 << k)).min(Duration::from_secs(4));
                assert!(
                    *w + eps >= d / 2 && *w <= d + eps,
                    "retry {k}: {w:?} for d = {d:?}"
                );
            }
            first.push(waits[0]);
        }
        // Random, over the whole range.
        let lo = first.iter().min().unwrap();
        let hi = first.iter().max().unwrap();
        assert!(*lo < Duration::from_millis(300) && *hi > Duration::from_millis(450));
        // No retries: no waits; an initial above the cap is the cap.
        assert_eq!(
            RetryPolicy::new(0, Duration::ZERO, Duration::ZERO)
                .delays()
                .count(),
            0
        );
        let w: Vec<_> = RetryPolicy::new(2, Duration::from_secs(9), Duration::from_secs(2))
            .delays()
            .collect();
        assert!(
            w.iter().all(|w| *w <= Duration::from_secs(2) + eps),
            "{w:?}"
        );
    }

    #[test]
    fn retry_after_overrides_the_backoff_but_not_the_budget() {
        let ms = Duration::from_millis;
        assert_eq!(next_wait(Some(ms(100)), None), Some(ms(100)));
        assert_eq!(next_wait(Some(ms(100)), Some(ms(7))), Some(ms(7)));
        assert_eq!(
            next_wait(Some(ms(100)), Some(ms(7_000_000))),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(next_wait(None, Some(ms(7))), None);
    }

    #[derive(Debug, PartialEq)]
    struct Fail {
        retryable: bool,
        after: Option<Duration>,
    }
    impl RetryDecision for Fail {
        fn retryable(&self) -> bool {
            self.retryable
        }
        fn retry_after(&self) -> Option<Duration> {
            self.after
        }
    }

    fn block_on<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn retry_runs_until_success_a_fatal_error_or_the_budget() {
        // Backoff of an hour: only the server's 20 ms Retry-After lets this finish quickly.
        let p = RetryPolicy::new(3, Duration::from_secs(3600), Duration::from_secs(3600));
        let calls = AtomicU32::new(0);
        let mut waits = Vec::new();
        let t0 = Instant::now();
        let r = block_on(p.retry(
            || async {
                match calls.fetch_add(1, Ordering::Relaxed) {
                    0 | 1 => Err(Fail {
                        retryable: true,
                        after: Some(Duration::from_millis(20)),
                    }),
                    n => Ok(n),
                }
            },
            |_, w| waits.push(w),
        ));
        assert_eq!(r, Ok(2));
        assert_eq!(waits, vec![Duration::from_millis(20); 2]);
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(40) && took < Duration::from_secs(5));

        // A fatal error is not retried.
        calls.store(0, Ordering::Relaxed);
        let r: Result<(), Fail> = block_on(p.retry(
            || async {
                calls.fetch_add(1, Ordering::Relaxed);
                Err(Fail {
                    retryable: false,
                    after: None,
                })
            },
            |_, _| {},
        ));
        assert!(r.is_err());
        assert_eq!(calls.load(Ordering::Relaxed), 1);

        // The budget: 1 + max_retries attempts, then the last error.
        let p = RetryPolicy::new(3, Duration::from_millis(2), Duration::from_millis(4));
        calls.store(0, Ordering::Relaxed);
        let r: Result<(), Fail> = block_on(p.retry(
            || async {
                calls.fetch_add(1, Ordering::Relaxed);
                Err(Fail {
                    retryable: true,
                    after: None,
                })
            },
            |_, _| {},
        ));
        assert!(r.is_err());
        assert_eq!(calls.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn retryable_statuses() {
        for s in [408, 409, 429, 500, 502, 503, 504] {
            assert!(retryable_status(s), "{s}");
        }
        for s in [200, 400, 401, 403, 404, 415, 422] {
            assert!(!retryable_status(s), "{s}");
        }
    }
}
