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

/// `Retry-After` as seconds (integer or decimal) or OpenAI's `retry-after-ms`; HTTP dates are
/// not understood (the judge's own backoff applies then).
pub(crate) fn retry_after(headers: &[(&str, Option<&str>)]) -> Option<Duration> {
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
    let secs = get("retry-after")?.trim().parse::<f64>().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(600.0)))
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
