//! The HTTP client against small servers that misbehave: no answer, bad
//! JSON, the wrong shape, a connection closed mid-reply, 5xx then success,
//! 4xx. Each checks the error's kind, its one-line message, what the server
//! saw (retries reuse the step index) and the metric counts.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use asyncrl_environment::{
    Action, ActionToolCall, EnvError, EnvTask, Environment, HttpEnvSettings, HttpEnvironment,
};
use asyncrl_telemetry::Metrics;
use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What a test server received: the JSON bodies, in order.
type Seen = Arc<Mutex<Vec<Value>>>;

async fn serve(router: Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

fn client(url: &str, call_timeout: Duration, retries: u32) -> HttpEnvironment {
    let settings = HttpEnvSettings {
        url: url.to_owned(),
        call_timeout,
        retries,
        backoff: (Duration::from_millis(1), Duration::from_millis(20)),
    };
    HttpEnvironment::new(settings, &Metrics::new()).unwrap()
}

fn task() -> EnvTask {
    EnvTask {
        task_id: "t7".into(),
        dataset: "hidden_sum".into(),
        prompt: json!("7+x="),
        answer: "19".into(),
        metadata: json!({ "x": 12 }),
    }
}

fn ok_reply() -> Value {
    json!({
        "observation": { "messages": [{ "role": "tool", "content": "x=12" }] },
        "reward": null,
        "done": false
    })
}

fn seen_steps(seen: &Seen) -> Vec<Value> {
    seen.lock()
        .unwrap()
        .iter()
        .map(|b| b["step"].clone())
        .collect()
}

/// Asserts the counts of `step` attempts by outcome and of its retries.
fn assert_step_metrics(env: &HttpEnvironment, outcomes: &[(&str, u64)], retries: u64) {
    for outcome in [
        "ok",
        "timeout",
        "connection",
        "status",
        "malformed",
        "refused",
    ] {
        let want = outcomes
            .iter()
            .find(|(o, _)| *o == outcome)
            .map_or(0, |(_, n)| *n);
        assert_eq!(
            env.metrics().call_count("step", outcome),
            want,
            "step attempts with outcome {outcome}"
        );
    }
    assert_eq!(env.metrics().retry_count("step"), retries, "step retries");
}

#[tokio::test]
async fn the_wire_bodies_are_the_protocols() {
    let seen = Seen::default();
    let record = |seen: Seen, reply: Value| {
        move |Json(body): Json<Value>| async move {
            seen.lock().unwrap().push(body);
            Json(reply)
        }
    };
    let reset_reply = json!({
        "observation": { "messages": [], "tools": [{ "type": "function", "function": { "name": "lookup" } }] },
        "reward": null,
        "done": false
    });
    let router = Router::new()
        .route("/reset", post(record(seen.clone(), reset_reply)))
        .route("/step", post(record(seen.clone(), ok_reply())))
        .route(
            "/close",
            post(record(seen.clone(), json!({ "closed": true }))),
        );
    let url = serve(router).await;
    let env = client(&format!("{url}/"), Duration::from_secs(10), 0);
    assert_eq!(env.name(), url, "the trailing / is dropped");

    let reset = env.reset("ep-1", &task()).await.unwrap();
    assert_eq!(reset.observation.tools.len(), 1);
    assert_eq!((reset.reward, reset.done), (None, false));
    let action = Action {
        content: "let me look".into(),
        tool_calls: vec![ActionToolCall {
            id: Some("call-1".into()),
            name: "lookup".into(),
            arguments: json!({ "name": "x" }),
        }],
    };
    let step = env.step("ep-1", 1, &action).await.unwrap();
    assert_eq!(step.observation.messages[0].content, "x=12");
    env.close("ep-1").await;

    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            json!({
                "episode_id": "ep-1",
                "task": {
                    "task_id": "t7", "dataset": "hidden_sum", "prompt": "7+x=",
                    "answer": "19", "metadata": { "x": 12 }
                }
            }),
            json!({
                "episode_id": "ep-1",
                "step": 1,
                "action": {
                    "content": "let me look",
                    "tool_calls": [{ "id": "call-1", "name": "lookup", "arguments": { "name": "x" } }]
                }
            }),
            json!({ "episode_id": "ep-1" }),
        ]
    );
    let m = env.metrics();
    assert_eq!(m.call_count("reset", "ok"), 1);
    assert_eq!(m.call_count("close", "ok"), 1);
    assert_step_metrics(&env, &[("ok", 1)], 0);
}

#[tokio::test]
async fn an_env_that_never_answers_times_out_after_each_attempt() {
    let seen = Seen::default();
    let router = Router::new()
        .route(
            "/step",
            post(
                |State(seen): State<Seen>, Json(body): Json<Value>| async move {
                    seen.lock().unwrap().push(body);
                    std::future::pending::<()>().await;
                },
            ),
        )
        .with_state(seen.clone());
    let url = serve(router).await;
    // A real (short) timeout: what is tested is the bound, not a speed.
    let env = client(&url, Duration::from_millis(300), 1);
    let started = std::time::Instant::now();
    let err = env.step("e", 4, &Action::text("x?")).await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(matches!(err, EnvError::Timeout { .. }), "{err:?}");
    assert_eq!(err.kind(), "timeout");
    assert_eq!(
        err.to_string(),
        format!("environment {url} step: no reply within 300ms")
    );
    assert!(
        elapsed >= Duration::from_millis(600) && elapsed < Duration::from_secs(10),
        "two attempts of 300 ms took {elapsed:?}"
    );
    assert_eq!(seen_steps(&seen), vec![json!(4), json!(4)]);
    assert_step_metrics(&env, &[("timeout", 2)], 1);
}

#[tokio::test]
async fn a_reply_that_is_not_json_is_malformed_and_not_retried() {
    let seen = Seen::default();
    let router = Router::new()
        .route(
            "/step",
            post(
                |State(seen): State<Seen>, Json(body): Json<Value>| async move {
                    seen.lock().unwrap().push(body);
                    "<html>\nnot json at all</html>"
                },
            ),
        )
        .with_state(seen.clone());
    let url = serve(router).await;
    let env = client(&url, Duration::from_secs(10), 3);
    let err = env.step("e", 1, &Action::text("x?")).await.unwrap_err();
    assert_eq!(err.kind(), "malformed");
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "environment {url} step: malformed reply: not JSON ("
        )),
        "{message}"
    );
    assert!(
        message.ends_with("<html> not json at all</html>"),
        "{message}"
    );
    assert!(!message.contains('\n'), "{message}");
    assert_eq!(seen_steps(&seen).len(), 1, "not retried");
    assert_step_metrics(&env, &[("malformed", 1)], 0);
}

#[tokio::test]
async fn replies_of_the_wrong_shape_are_malformed() {
    let router = Router::new().route(
        "/step",
        post(|Json(body): Json<Value>| async move {
            Json(match body["episode_id"].as_str() {
                Some("shape") => json!({ "observation": "hello", "done": "yes" }),
                Some("role") => json!({
                    "observation": { "messages": [{ "role": "wizard", "content": "hi" }] },
                    "done": false
                }),
                Some("reward") => json!({
                    "observation": { "messages": [] }, "reward": 1e39, "done": true
                }),
                _ => json!({ "observation": { "messages": [] } }),
            })
        }),
    );
    let url = serve(router).await;
    let env = client(&url, Duration::from_secs(10), 3);
    let cases = [
        ("shape", "wrong shape (invalid type: string"),
        ("role", "a message has the unknown role \"wizard\""),
        ("reward", "is not a finite f32"),
        ("missing", "wrong shape (missing field `done`"),
    ];
    for (episode, what) in cases {
        let err = env.step(episode, 1, &Action::text("x?")).await.unwrap_err();
        let message = err.to_string();
        assert_eq!(err.kind(), "malformed", "{message}");
        assert!(
            message.starts_with(&format!("environment {url} step: malformed reply: ")),
            "{message}"
        );
        assert!(message.contains(what), "{episode}: {message}");
    }
    assert_step_metrics(&env, &[("malformed", 4)], 0);
}

/// Reads one HTTP request (headers and a Content-Length body) from `socket`.
async fn read_request(socket: &mut tokio::net::TcpStream) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = socket.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the client closed before sending its request");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return buf;
            }
        }
    }
}

#[tokio::test]
async fn a_connection_closed_mid_reply_is_retried_then_fails() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let server_seen = seen.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let request = read_request(&mut socket).await;
            server_seen
                .lock()
                .unwrap()
                .push(String::from_utf8_lossy(&request).to_string());
            // Promises 200 bytes, sends 16, and closes.
            socket
                .write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{\"observation\":",
                )
                .await
                .unwrap();
            drop(socket);
        }
    });
    let env = client(&url, Duration::from_secs(10), 2);
    let err = env.step("e", 2, &Action::text("19")).await.unwrap_err();
    assert_eq!(err.kind(), "connection", "{err}");
    let message = err.to_string();
    assert!(
        message.starts_with(&format!("environment {url} step: connection failed: ")),
        "{message}"
    );
    assert!(!message.contains('\n'), "{message}");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3, "one attempt and two retries");
    assert!(
        seen.iter().all(|r| r.contains("\"step\":2")),
        "each attempt sends step 2: {seen:?}"
    );
    assert_step_metrics(&env, &[("connection", 3)], 2);
}

#[tokio::test]
async fn a_refused_connection_is_a_connection_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let env = client(&url, Duration::from_secs(10), 1);
    let err = env.reset("e", &task()).await.unwrap_err();
    assert_eq!(err.kind(), "connection", "{err}");
    let message = err.to_string();
    assert!(
        message.starts_with(&format!("environment {url} reset: connection failed: ")),
        "{message}"
    );
    assert!(
        message.to_lowercase().contains("connection refused"),
        "{message}"
    );
    assert_eq!(env.metrics().call_count("reset", "connection"), 2);
    assert_eq!(env.metrics().retry_count("reset"), 1);
}

#[tokio::test]
async fn a_500_is_retried_with_the_same_step_and_then_succeeds() {
    let seen = Seen::default();
    let router = Router::new()
        .route(
            "/step",
            post(
                |State(seen): State<Seen>, Json(body): Json<Value>| async move {
                    let mut seen = seen.lock().unwrap();
                    seen.push(body);
                    if seen.len() == 1 {
                        (StatusCode::INTERNAL_SERVER_ERROR, "tool backend busy").into_response()
                    } else {
                        Json(ok_reply()).into_response()
                    }
                },
            ),
        )
        .with_state(seen.clone());
    let url = serve(router).await;
    let env = client(&url, Duration::from_secs(10), 2);
    let reply = env.step("e", 3, &Action::text("x?")).await.unwrap();
    assert_eq!(reply.observation.messages[0].content, "x=12");
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.iter().map(|b| b["step"].clone()).collect::<Vec<_>>(),
        vec![json!(3), json!(3)],
        "the retry repeats step 3"
    );
    assert_eq!(seen[0], seen[1], "the retry sends the same body");
    drop(seen);
    assert_step_metrics(&env, &[("status", 1), ("ok", 1)], 1);
}

#[tokio::test]
async fn a_5xx_that_persists_fails_after_the_retries() {
    let router = Router::new().route(
        "/step",
        post(|| async { (StatusCode::SERVICE_UNAVAILABLE, "down for\nmaintenance") }),
    );
    let url = serve(router).await;
    let env = client(&url, Duration::from_secs(10), 2);
    let err = env.step("e", 1, &Action::text("x?")).await.unwrap_err();
    assert!(
        matches!(err, EnvError::Status { status: 503, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("environment {url} step: HTTP 503: down for maintenance")
    );
    assert_step_metrics(&env, &[("status", 3)], 2);
}

#[tokio::test]
async fn a_400_is_refused_and_not_retried() {
    let seen = Seen::default();
    let router = Router::new()
        .route(
            "/step",
            post(
                |State(seen): State<Seen>, Json(body): Json<Value>| async move {
                    seen.lock().unwrap().push(body);
                    (
                        StatusCode::BAD_REQUEST,
                        Json(json!({ "error": "unknown episode 'e'" })),
                    )
                },
            ),
        )
        .with_state(seen.clone());
    let url = serve(router).await;
    let env = client(&url, Duration::from_secs(10), 3);
    let err = env.step("e", 1, &Action::text("x?")).await.unwrap_err();
    assert!(matches!(err, EnvError::Refused { .. }), "{err:?}");
    assert!(!err.is_transient());
    assert_eq!(
        err.to_string(),
        format!("environment {url} step refused: HTTP 400: unknown episode 'e'")
    );
    assert_eq!(seen_steps(&seen).len(), 1, "not retried");
    assert_step_metrics(&env, &[("refused", 1)], 0);
}

#[tokio::test]
async fn a_404_without_a_json_error_is_refused_with_its_body() {
    // No routes: axum answers 404 with an empty body.
    let url = serve(Router::new()).await;
    let env = client(&url, Duration::from_secs(10), 3);
    let err = env.reset("e", &task()).await.unwrap_err();
    assert_eq!(err.kind(), "refused");
    assert_eq!(
        err.to_string(),
        format!("environment {url} reset refused: HTTP 404: (empty body)")
    );
    assert_eq!(env.metrics().retry_count("reset"), 0);
}

#[tokio::test]
async fn a_failed_close_is_counted_not_returned() {
    let router = Router::new().route(
        "/close",
        post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "oops") }),
    );
    let url = serve(router).await;
    let env = client(&url, Duration::from_secs(10), 3);
    env.close("e").await;
    assert_eq!(env.metrics().call_count("close", "status"), 1);
    assert_eq!(
        env.metrics().retry_count("close"),
        0,
        "close is one attempt"
    );
}

#[test]
fn bad_urls_are_refused_at_construction() {
    for (url, what) in [
        ("https://env:8000", "only http:// is supported"),
        ("not a url", "relative URL without a base"),
        ("http://env:8000/?a=1", "must not have a query"),
    ] {
        let err = HttpEnvironment::new(HttpEnvSettings::new(url), &Metrics::new()).unwrap_err();
        let message = err.to_string();
        assert!(
            message.starts_with(&format!("environment URL {url:?}: ")) && message.contains(what),
            "{message}"
        );
    }
}
