//! The HTTP layer under async-openai: a tower service that keeps the status and `Retry-After`
//! of failed responses (async-openai's own error drops the headers), so the judge's retry loop
//! can honour them. async-openai's built-in retry layer is replaced by ours.

use std::task::{Context, Poll};
use std::time::Duration;

use async_openai::error::OpenAIError;
use async_openai::middleware::{HttpRequestFactory, ReqwestService};
use tower_service::Service;

use crate::reward::BoxFuture;

type HttpResponse = <ReqwestService as Service<HttpRequestFactory>>::Response;

/// A non-2xx answer.
#[derive(Debug, Clone)]
pub(crate) struct HttpFailure {
    pub status: u16,
    pub retry_after: Option<Duration>,
    pub body: String,
}

impl std::fmt::Display for HttpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HTTP {}: {}",
            self.status,
            super::parse::snippet(&self.body)
        )
    }
}

impl std::error::Error for HttpFailure {}

/// `Retry-After` as seconds (integer or decimal) or as an HTTP date (RFC 7231: IMF-fixdate, and
/// the obsolete RFC 850 / asctime forms; a date in the past means "now"), or OpenAI's
/// `retry-after-ms`. Capped at 10 minutes; anything else is ignored (the judge's own backoff
/// applies then).
pub(crate) fn retry_after(headers: &[(&str, Option<&str>)]) -> Option<Duration> {
    retry_after_at(headers, std::time::SystemTime::now())
}

/// [`retry_after`] with the current time given (dates are relative to it).
pub(crate) fn retry_after_at(
    headers: &[(&str, Option<&str>)],
    now: std::time::SystemTime,
) -> Option<Duration> {
    let get = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| *v)
    };
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.trim().parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64((ms / 1000.0).min(600.0)));
    }
    let value = get("retry-after")?.trim();
    if let Ok(secs) = value.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(600.0)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let wait = at.duration_since(now).unwrap_or(Duration::ZERO);
    Some(wait.min(Duration::from_secs(600)))
}

/// `ReqwestService` that turns non-2xx responses into `OpenAIError::Boxed(HttpFailure)`.
#[derive(Clone, Debug, Default)]
pub(crate) struct StatusAware {
    inner: ReqwestService,
}

impl Service<HttpRequestFactory> for StatusAware {
    type Response = HttpResponse;
    type Error = OpenAIError;
    type Future = BoxFuture<'static, Result<HttpResponse, OpenAIError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), OpenAIError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: HttpRequestFactory) -> Self::Future {
        // async-openai always sends `Authorization: Bearer <key>`; a judge without a key
        // (no `api_key_env`) sends no such header rather than an empty token.
        let req = HttpRequestFactory::new(move || {
            let req = req.clone();
            async move {
                let mut r = req.build().await?;
                let empty = r
                    .headers()
                    .get("authorization")
                    .is_some_and(|v| v.as_bytes().trim_ascii() == b"Bearer");
                if empty {
                    r.headers_mut().remove("authorization");
                }
                Ok(r)
            }
        });
        let fut = self.inner.call(req);
        Box::pin(async move {
            let response = fut.await?;
            let status = response.status();
            if status.is_success() {
                return Ok(response);
            }
            let h = response.headers();
            let ra = retry_after(&[
                (
                    "retry-after",
                    h.get("retry-after").and_then(|v| v.to_str().ok()),
                ),
                (
                    "retry-after-ms",
                    h.get("retry-after-ms").and_then(|v| v.to_str().ok()),
                ),
            ]);
            let body = response.text().await.unwrap_or_default();
            Err(OpenAIError::Boxed(Box::new(HttpFailure {
                status: status.as_u16(),
                retry_after: ra,
                body,
            })))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    #[test]
    fn retry_after_seconds_dates_and_ms() {
        // 2015-10-21T07:28:00Z
        let now = UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        let ra = |v: &str| retry_after_at(&[("Retry-After", Some(v))], now);
        assert_eq!(ra("3"), Some(Duration::from_secs(3)));
        assert_eq!(ra(" 1.5 "), Some(Duration::from_millis(1500)));
        assert_eq!(
            ra("Wed, 21 Oct 2015 07:28:30 GMT"),
            Some(Duration::from_secs(30))
        );
        // RFC 850 and asctime forms, which RFC 7231 says to accept.
        assert_eq!(
            ra("Wednesday, 21-Oct-15 07:28:05 GMT"),
            Some(Duration::from_secs(5))
        );
        assert_eq!(ra("Wed Oct 21 07:28:07 2015"), Some(Duration::from_secs(7)));
        assert_eq!(ra("Wed, 21 Oct 2015 07:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(
            ra("Thu, 22 Oct 2015 07:28:00 GMT"),
            Some(Duration::from_secs(600))
        );
        assert_eq!(ra("-1"), None);
        assert_eq!(ra("tomorrow"), None);
        let both = [("retry-after", Some("9")), ("retry-after-ms", Some("250"))];
        assert_eq!(retry_after_at(&both, now), Some(Duration::from_millis(250)));
        assert_eq!(retry_after_at(&[], SystemTime::now()), None);
    }
}
