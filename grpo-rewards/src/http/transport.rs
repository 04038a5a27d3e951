//! The HTTP layer under async-openai: a tower service that keeps the status and `Retry-After`
//! of failed responses (async-openai's own error drops the headers), so the retry policy can
//! honour them. async-openai's built-in retry layer is replaced by [`super::RetryPolicy`].

use std::task::{Context, Poll};
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::{HttpRequestFactory, ReqwestService};
use tower_service::Service;

use super::retry::{retry_after, retry_after_ms};
use crate::reward::BoxFuture;

type HttpResponse = <ReqwestService as Service<HttpRequestFactory>>::Response;

/// A non-2xx answer, as `OpenAIError::Boxed(Box<HttpFailure>)` from a client that uses
/// [`StatusAware`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpFailure {
    /// The HTTP status.
    pub status: u16,
    /// The wait the server asked for: `retry-after-ms` when present, else `Retry-After`
    /// (see [`super::retry_after`]).
    pub retry_after: Option<Duration>,
    /// The body, as text.
    pub body: String,
}

impl HttpFailure {
    /// The `HttpFailure` inside an async-openai error, if that is what it is.
    pub fn of(e: &OpenAIError) -> Option<&HttpFailure> {
        match e {
            OpenAIError::Boxed(b) => b.downcast_ref::<HttpFailure>(),
            _ => None,
        }
    }
}

impl std::fmt::Display for HttpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status, super::snippet(&self.body))
    }
}

impl std::error::Error for HttpFailure {}

/// async-openai's `ReqwestService` that turns non-2xx responses into
/// `OpenAIError::Boxed(Box<HttpFailure>)`, keeping the status, the server's `Retry-After` and the
/// body, and sends no `Authorization` header when the key is empty. No retries of its own.
#[derive(Clone, Debug, Default)]
pub struct StatusAware {
    inner: ReqwestService,
}

impl StatusAware {
    /// Sends one request (no retry): the response when its status is 2xx, else an
    /// [`HttpFailure`].
    pub async fn send(&self, request: HttpRequestFactory) -> Result<HttpResponse, OpenAIError> {
        self.clone().call(request).await
    }
}

/// An async-openai client of the OpenAI-compatible API at `base_url` (e.g.
/// `http://127.0.0.1:8000/v1`) with `api_key` (empty: none) over [`StatusAware`]. Nothing is
/// taken from `OPENAI_*` environment variables behind the caller's back: no organisation, no
/// project, and the key and base given.
pub fn openai_client(base_url: &str, api_key: &str) -> Client<OpenAIConfig> {
    let config = OpenAIConfig::new()
        .with_api_base(base_url.trim_end_matches('/'))
        .with_api_key(api_key)
        .with_org_id("")
        .with_project_id("");
    Client::with_config(config).with_http_service(StatusAware::default())
}

impl Service<HttpRequestFactory> for StatusAware {
    type Response = HttpResponse;
    type Error = OpenAIError;
    type Future = BoxFuture<'static, Result<HttpResponse, OpenAIError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), OpenAIError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: HttpRequestFactory) -> Self::Future {
        // async-openai always sends `Authorization: Bearer <key>`; a client without a key (a
        // judge without `api_key_env`, a local vLLM) sends no such header, not an empty token.
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
            let header = |name: &str| h.get(name).and_then(|v| v.to_str().ok());
            let ra = header("retry-after-ms")
                .and_then(retry_after_ms)
                .or_else(|| header("retry-after").and_then(retry_after));
            let body = response.text().await.unwrap_or_default();
            Err(OpenAIError::Boxed(Box::new(HttpFailure {
                status: status.as_u16(),
                retry_after: ra,
                body,
            })))
        })
    }
}
