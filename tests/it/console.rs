//! The operator console (issue 14) in a real browser: Debian's headless Chromium driven
//! through chromedriver by fantoccini. It logs in with the admin token, loads every page
//! of the outbox and of an inbox subscription, filters the backlog, requeues a failed
//! event through the UI (preview, then confirm) and sees it published in the local
//! sink's file and in the audit log.
//!
//! `MAILROOM_CONSOLE_SCREENSHOTS=DIR` saves a PNG of each page there (docs/img).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::support::*;
use fantoccini::{Client, ClientBuilder, Locator};
use mailroom::config::{Config, Settings};
use mailroom::domain::{BoxKind, Status, StoredEvent};
use mailroom::pb;
use mailroom::pb::handler_service_server::HandlerService;
use mailroom::sink::local::LocalSink;
use mailroom::sink::{Delivery, Failure, Sink};
use tonic::{Request, Response, Status as GrpcStatus};

const TOKEN: &str = "console-admin-token-0123456789";

/// The local sink, except that topics in `failing` fail (counted) while it is set.
struct FlakySink {
    inner: LocalSink,
    failing: AtomicBool,
}

#[async_trait::async_trait]
impl Sink for FlakySink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let failing = self.failing.load(Ordering::SeqCst);
        let mut out = Vec::new();
        for line in lines {
            let bad = |e: &StoredEvent| e.topic == "flaky" || (failing && e.topic == "payments");
            if line.iter().any(|e| bad(e)) {
                out.push(
                    line.iter()
                        .map(|e| {
                            if bad(e) {
                                Delivery::Failed(Failure::Counted {
                                    error: format!(
                                        "broker refused {}: payment gateway timeout",
                                        e.topic
                                    ),
                                    retry_at: None,
                                })
                            } else {
                                Delivery::NotAttempted
                            }
                        })
                        .collect(),
                );
            } else {
                out.extend(self.inner.deliver(std::slice::from_ref(line)).await);
            }
        }
        out
    }
}

/// Handles everything except payload `reject`.
#[derive(Clone)]
struct Handler;

#[tonic::async_trait]
impl HandlerService for Handler {
    async fn handle(
        &self,
        request: Request<pb::HandleRequest>,
    ) -> Result<Response<pb::HandleResponse>, GrpcStatus> {
        use pb::handle_response::Outcome;
        let r = request.into_inner();
        let outcome = if r.payload == b"reject" {
            Outcome::Reject(pb::HandleReject {
                reason: "unknown customer".into(),
            })
        } else {
            Outcome::Success(pb::HandleSuccess {})
        };
        Ok(Response::new(pb::HandleResponse {
            outcome: Some(outcome),
        }))
    }
}

struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn start_browser() -> (Driver, Client) {
    let port = free_port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver is required (scripts/test.sh installs chromium-driver)");
    let driver = Driver(child);
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let profile = tempfile::tempdir().unwrap().keep();
    let caps = serde_json::json!({
        "goog:chromeOptions": {
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--window-size=1280,1000",
                format!("--user-data-dir={}", profile.display()),
            ]
        }
    });
    let caps = match caps {
        serde_json::Value::Object(m) => m,
        _ => unreachable!(),
    };
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a chromedriver session");
    (driver, client)
}

/// Saves a screenshot when `MAILROOM_CONSOLE_SCREENSHOTS` names a directory.
async fn shot(c: &Client, name: &str) {
    if let Ok(dir) = std::env::var("MAILROOM_CONSOLE_SCREENSHOTS") {
        let png = c.screenshot().await.unwrap();
        let path = PathBuf::from(dir).join(format!("console-{name}.png"));
        std::fs::write(&path, png).unwrap();
    }
}

async fn text(c: &Client, css: &str) -> String {
    c.wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css}: {e}"))
        .text()
        .await
        .unwrap()
}

/// Clicks what `css` finds and waits until the page it leads to has loaded (the old
/// document gone stale, the new one complete): a form submission is not awaited by
/// every driver, and a slow machine shows it.
async fn click_nav(c: &Client, css: &str) {
    let old = c.find(Locator::Css("html")).await.unwrap();
    c.find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css}: {e}"))
        .click()
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stale = old.tag_name().await.is_err();
        let ready = c
            .execute("return document.readyState", vec![])
            .await
            .ok()
            .and_then(|v| v.as_str().map(|s| s == "complete"))
            .unwrap_or(false);
        if stale && ready {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "clicking {css} did not load a page"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A raw HTTP/1.1 exchange (status line and body), for what a browser does not show.
/// `Host: x` stands for the console's own address (its host check refuses other names).
async fn http(addr: std::net::SocketAddr, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = request.replace("Host: x\r\n", &format!("Host: {addr}\r\n"));
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

async fn eventually_status(s: &Service, id: i64, want: Status, what: &str) {
    let store = s.app.store.clone();
    eventually(Duration::from_secs(20), what, || {
        let store = store.clone();
        async move {
            store
                .get_event(BoxKind::Outbox, id)
                .await
                .unwrap()
                .is_some_and(|e| e.status == want)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_real_browser() {
    let url = fresh_pg().await;
    let dir = tempfile::tempdir().unwrap();
    let handler = serve_handler(Handler).await;
    let toml = dir.path().join("mailroom.toml");
    std::fs::write(
        &toml,
        format!(
            "[[subscriptions]]\nname = \"billing\"\nhandler = \"{handler}\"\nmax_attempts = 3\n"
        ),
    )
    .unwrap();
    let mut c: Config = Config::load(Settings {
        config: Some(toml),
        listen: Some("127.0.0.1:0".into()),
        database_url: Some(url.clone()),
        console_listen: Some("127.0.0.1:0".into()),
        admin_token: Some(TOKEN.into()),
        ..Default::default()
    })
    .expect("config");
    c.relay.poll_interval = Duration::from_millis(50);
    c.relay.retry.base = Duration::from_secs(600);
    c.relay.retry.cap = Duration::from_secs(600);
    let out = dir.path().join("published.jsonl");
    let sink = Arc::new(FlakySink {
        inner: LocalSink::file(out.clone()).await.unwrap(),
        failing: AtomicBool::new(true),
    });
    let mut s = Service::start_with_sink(c, sink.clone()).await;
    let console = s.app.console_addr.expect("console address");

    // The outbox: published lines, a failed payment, a blocked key, a delayed backlog.
    for k in 1..=3 {
        for i in 0..3 {
            enqueue(
                &mut s.client,
                event(
                    "orders",
                    &format!("order-{k}"),
                    format!("{{\"n\":{i}}}").as_bytes(),
                ),
            )
            .await;
        }
    }
    let mut pay = event(
        "payments",
        "pay-7",
        br#"{"amount": 4200, "currency": "EUR", "customer": "c-19"}"#,
    );
    pay.max_attempts = 1;
    pay.r#type = "payment.captured".into();
    pay.headers = BTreeMap::from([
        ("content-type".to_string(), "application/json".to_string()),
        ("source".to_string(), "checkout".to_string()),
    ])
    .into_iter()
    .collect();
    let failed_id = enqueue(&mut s.client, pay).await;
    let mut flaky = event("flaky", "acct-1", b"\x00\x01binary\xff");
    flaky.max_attempts = 5;
    let flaky_id = enqueue(&mut s.client, flaky).await;
    enqueue(&mut s.client, event("flaky", "acct-1", b"behind the head")).await;
    let later = prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() + 3600,
        nanos: 0,
    };
    for k in 1..=5 {
        for _ in 0..k {
            let mut e = event("slow", &format!("cust-{k}"), b"later");
            e.deliver_after = Some(later);
            enqueue(&mut s.client, e).await;
        }
    }
    eventually_status(&s, failed_id, Status::Failed, "the payment failed").await;
    let store = s.app.store.clone();
    eventually(Duration::from_secs(20), "the flaky head attempted", || {
        let store = store.clone();
        async move {
            store
                .get_event(BoxKind::Outbox, flaky_id)
                .await
                .unwrap()
                .is_some_and(|e| e.attempts >= 1)
        }
    })
    .await;

    // The inbox: one handled message, one rejected.
    let mut inbox = pb::inbox_service_client::InboxServiceClient::new(channel(s.app.addr).await);
    for (id, payload) in [("m-1", "hello"), ("m-2", "reject")] {
        inbox
            .receive(pb::ReceiveRequest {
                subscription: "billing".into(),
                message_id: id.into(),
                topic: "customers".into(),
                key: "c-19".into(),
                payload: payload.as_bytes().to_vec(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    // Without a token: the login form (browsers) or 401 (a wrong bearer token).
    let r = http(
        console,
        "GET /outbox HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 303") && r.contains("/login?next="),
        "{r}"
    );
    let r = http(
        console,
        "GET /outbox HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 401"), "{r}");
    let r = http(
        console,
        &format!("GET /outbox HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200") && r.contains("Outbox"), "{r}");
    // A POST without a session or token acts on nothing.
    let form = format!("action=requeue&id={failed_id}&confirm=yes");
    let r = http(
        console,
        &format!(
            "POST /outbox/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 303"), "{r}");

    // A session's forms must carry its CSRF token.
    let login = format!("token={TOKEN}&next=%2Foutbox");
    let r = http(
        console,
        &format!(
            "POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{login}",
            login.len()
        ),
    )
    .await;
    let session = r
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie: "))
        .map(|l| &l["set-cookie: ".len()..])
        .and_then(|c| c.split(';').next())
        .unwrap_or_else(|| panic!("no session cookie: {r}"))
        .to_string();
    let r = http(
        console,
        &format!(
            "POST /outbox/events HTTP/1.1\r\nHost: x\r\nCookie: {session}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    // And a cross-origin POST is refused even with a bearer token.
    let r = http(
        console,
        &format!(
            "POST /outbox/events HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    let e = s
        .app
        .store
        .get_event(BoxKind::Outbox, failed_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(e.status, Status::Failed, "no request above acted");

    let (_driver, b) = start_browser().await;
    let base = format!("http://{console}");

    // Log in.
    b.goto(&format!("{base}/outbox")).await.unwrap();
    assert!(b.current_url().await.unwrap().path().starts_with("/login"));
    shot(&b, "login").await;
    b.find(Locator::Css("#token"))
        .await
        .unwrap()
        .send_keys("wrong-token")
        .await
        .unwrap();
    click_nav(&b, "#login").await;
    assert!(text(&b, "[role=alert]").await.contains("not valid"));
    b.find(Locator::Css("#token"))
        .await
        .unwrap()
        .send_keys(TOKEN)
        .await
        .unwrap();
    click_nav(&b, "#login").await;
    assert_eq!(b.current_url().await.unwrap().path(), "/outbox");

    // Overview.
    assert_eq!(text(&b, "#failed .n").await, "1");
    assert_eq!(text(&b, "#blocked .n").await, "1");
    let pending: i64 = text(&b, "#pending .n").await.parse().unwrap();
    assert_eq!(pending, 2 + 15);
    let rate: i64 = text(&b, ".rate-total").await.parse().unwrap();
    assert_eq!(rate, 9, "nine order events published");
    assert!(text(&b, "#topics").await.contains("payments"));
    assert!(b.find(Locator::Css("figure.chart svg rect")).await.is_ok());
    shot(&b, "overview").await;

    // Backlog by key: blocked keys first, then filter by topic.
    b.goto(&format!("{base}/outbox/backlog")).await.unwrap();
    let first_table = text(&b, "table.backlog").await;
    assert!(
        first_table.contains("acct-1") && first_table.contains("blocked"),
        "{first_table}"
    );
    assert!(first_table.contains("broker refused flaky"));
    assert!(text(&b, "#totals").await.contains("17 pending in 6 keys"));
    shot(&b, "backlog").await;
    b.find(Locator::Css("#f-topic"))
        .await
        .unwrap()
        .send_keys("slow")
        .await
        .unwrap();
    click_nav(&b, "#f-apply").await;
    let rows = b
        .find_all(Locator::Css("table.backlog tbody tr"))
        .await
        .unwrap();
    assert_eq!(rows.len(), 5, "five keys of topic slow");
    // Most pending first: cust-5 (5 events) heads the list.
    assert_eq!(
        rows[0].attr("data-key").await.unwrap().as_deref(),
        Some("cust-5")
    );
    assert!(text(&b, "#totals").await.contains("15 pending in 5 keys"));
    // Keyset paging keeps the filter (a page of 50 holds all 5 here: no next link).
    assert!(b.find(Locator::Css("#next-page")).await.is_err());
    // Two keys a page: three pages, every key once, in order, the filter kept.
    b.goto(&format!("{base}/outbox/backlog?topic=slow&size=2"))
        .await
        .unwrap();
    let mut keys = Vec::new();
    loop {
        for r in b
            .find_all(Locator::Css("table.backlog tbody tr"))
            .await
            .unwrap()
        {
            keys.push(r.attr("data-key").await.unwrap().unwrap());
        }
        if b.find(Locator::Css("#next-page")).await.is_err() {
            break;
        }
        click_nav(&b, "#next-page").await;
    }
    assert_eq!(keys, ["cust-5", "cust-4", "cust-3", "cust-2", "cust-1"]);

    // One event: headers, pretty JSON, error, its key's line.
    b.goto(&format!("{base}/outbox/events/{failed_id}"))
        .await
        .unwrap();
    let json = text(&b, "#payload-json").await;
    assert!(json.contains("\"amount\": 4200"), "pretty-printed: {json}");
    assert!(text(&b, "#headers").await.contains("checkout"));
    assert!(
        text(&b, "#last-error")
            .await
            .contains("payment gateway timeout")
    );
    assert!(text(&b, "#attempts").await.contains("1 of 1"));
    assert!(b.find(Locator::Css("#line tr.this")).await.is_ok());
    shot(&b, "event").await;
    b.goto(&format!("{base}/outbox/events/{flaky_id}"))
        .await
        .unwrap();
    assert!(text(&b, "#payload-hex").await.contains("00 01 62 69"));
    assert_eq!(
        b.find_all(Locator::Css("#line tbody tr"))
            .await
            .unwrap()
            .len(),
        2,
        "the key's two events"
    );

    // Failed events: select, preview, confirm; then it is published.
    b.goto(&format!("{base}/outbox/events")).await.unwrap();
    assert!(text(&b, "#events").await.contains("payments"));
    shot(&b, "failed").await;
    sink.failing.store(false, Ordering::SeqCst);
    b.find(Locator::Css(&format!("#sel-{failed_id}")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    click_nav(&b, "#requeue-selected").await;
    assert!(text(&b, "#preview").await.contains("would requeue 1 event"));
    shot(&b, "requeue-preview").await;
    // The dry run changed nothing.
    let e = s
        .app
        .store
        .get_event(BoxKind::Outbox, failed_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(e.status, Status::Failed);
    click_nav(&b, "#confirm").await;
    assert!(text(&b, "#done").await.contains("requeue 1 event"));
    eventually_status(
        &s,
        failed_id,
        Status::Completed,
        "the requeued payment published",
    )
    .await;
    let published = std::fs::read_to_string(&out).unwrap();
    assert!(
        published
            .lines()
            .any(|l| l.contains(&format!("\"id\":{failed_id},"))
                && l.contains("\"topic\":\"payments\"")),
        "{published}"
    );

    // The audit log shows who did it.
    b.goto(&format!("{base}/audit")).await.unwrap();
    let audit = text(&b, "#audit").await;
    assert!(
        audit.contains("requeue") && audit.contains("console (token)"),
        "{audit}"
    );
    shot(&b, "audit").await;

    // The inbox subscription's pages.
    b.goto(&format!("{base}/inbox/billing")).await.unwrap();
    let store = s.app.store.clone();
    eventually(Duration::from_secs(20), "inbox settled", || {
        let store = store.clone();
        async move {
            store
                .count_events(BoxKind::Inbox, Some(Status::Pending))
                .await
                .unwrap()
                == 0
        }
    })
    .await;
    b.refresh().await.unwrap();
    assert_eq!(text(&b, "#failed .n").await, "1");
    assert_eq!(text(&b, "#completed .n").await, "1");
    shot(&b, "inbox").await;
    b.goto(&format!("{base}/inbox/billing/backlog"))
        .await
        .unwrap();
    assert!(
        b.find(Locator::Css("#empty")).await.is_ok(),
        "nothing pending"
    );
    b.goto(&format!("{base}/inbox/billing/events"))
        .await
        .unwrap();
    let failed = text(&b, "#events").await;
    assert!(
        failed.contains("unknown customer") && failed.contains("c-19"),
        "{failed}"
    );

    // Pause an outbox topic from the topic table with a reason a hostile page might
    // carry (shown as text, never markup), then resume it (issue 28, item 1).
    b.goto(&format!("{base}/outbox")).await.unwrap();
    let row = b
        .find(Locator::Css("#topics tbody tr[data-topic]"))
        .await
        .unwrap();
    let topic = row.attr("data-topic").await.unwrap().unwrap();
    row.find(Locator::Css("input[name=reason]"))
        .await
        .unwrap()
        .send_keys("<b>maintenance</b>")
        .await
        .unwrap();
    click_nav(
        &b,
        &format!("#topics tr[data-topic='{topic}'] button[value=pause]"),
    )
    .await;
    let notice = text(&b, ".notice.paused").await;
    assert!(
        notice.contains(&topic) && notice.contains("<b>maintenance</b>"),
        "{notice}"
    );
    assert!(
        b.find(Locator::Css(".notice.paused b")).await.is_err(),
        "the reason is text"
    );
    assert!(
        text(&b, &format!("#topics tr[data-topic='{topic}']"))
            .await
            .contains("paused")
    );
    shot(&b, "paused").await;
    click_nav(
        &b,
        &format!("#topics tr[data-topic='{topic}'] button[value=resume]"),
    )
    .await;
    assert!(
        b.find(Locator::Css(".notice.paused")).await.is_err(),
        "resumed"
    );
    b.goto(&format!("{base}/audit")).await.unwrap();
    let audit = text(&b, "main").await;
    assert!(
        audit.contains("pause") && audit.contains("resume"),
        "{audit}"
    );

    // The overview refreshes in place (issue 44, item 5): a new pending event shows
    // without a reload (a mark set on the page's window survives).
    b.goto(&format!("{base}/outbox")).await.unwrap();
    let pending: i64 = text(&b, "#pending .n").await.parse().unwrap();
    b.execute("window.mailroomMark = 7", vec![]).await.unwrap();
    let mut later = event("live.t", "k", b"x");
    later.deliver_after = Some(mailroom::pb::time::to_timestamp(
        chrono::Utc::now() + chrono::Duration::hours(1),
    ));
    enqueue(&mut s.client, later).await;
    b.execute("return mailroomRefresh()", vec![]).await.unwrap();
    let want = (pending + 1).to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while text(&b, "#pending .n").await != want {
        assert!(
            std::time::Instant::now() < deadline,
            "the overview did not refresh"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mark = b
        .execute("return window.mailroomMark", vec![])
        .await
        .unwrap();
    assert_eq!(mark, serde_json::json!(7), "refreshed without a reload");

    // Log out: back to the login form.
    click_nav(&b, "header form button").await;
    b.goto(&format!("{base}/outbox")).await.unwrap();
    assert!(b.current_url().await.unwrap().path().starts_with("/login"));

    b.close().await.unwrap();
    s.app.stop().await.unwrap();
}

/// `console_read_only`: pages show no actions and a POST is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_console_refuses_actions() {
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relays = 0;
    c.console_listen = Some("127.0.0.1:0".parse().unwrap());
    c.console_read_only = true;
    let mut s = Service::start(c).await;
    let console = s.app.console_addr.unwrap();
    let id = enqueue(&mut s.client, event("ro", "k", b"x")).await;
    let r = http(
        console,
        "GET /outbox/events?status=pending HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains("read-only"),
        "{r}"
    );
    assert!(
        r.contains(&format!("sel-{id}")) && !r.contains("cancel-selected"),
        "{r}"
    );
    let form = format!("action=cancel&id={id}&confirm=yes");
    let r = http(
        console,
        &format!(
            "POST /outbox/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    let e = s
        .app
        .store
        .get_event(BoxKind::Outbox, id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(e.status, Status::Pending);
    s.app.stop().await.unwrap();
}

/// A token with the `admin_read` scope (token file) sees every page, by bearer header and
/// through the login form, but no action form, and its POST is refused with nothing
/// changed; an `admin` token of the same console still gets the forms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_read_token_sees_the_console_without_actions() {
    use mailroom::access::{Scope, TokenEntry};
    const VIEWER: &str = "console-viewer-token-0123456789";
    let url = fresh_pg().await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    c.console_listen = Some("127.0.0.1:0".parse().unwrap());
    c.tokens = vec![
        TokenEntry {
            name: "viewer".into(),
            token: VIEWER.into(),
            certificate: None,
            scopes: vec![Scope::AdminRead],
            topics: None,
            subscriptions: None,
        },
        TokenEntry {
            name: "ops".into(),
            token: TOKEN.into(),
            certificate: None,
            scopes: vec![Scope::Admin, Scope::Enqueue],
            topics: None,
            subscriptions: None,
        },
    ];
    let sink = Arc::new(FlakySink {
        inner: LocalSink::file(dir.path().join("published.jsonl"))
            .await
            .unwrap(),
        failing: AtomicBool::new(true),
    });
    let s = Service::start_with_sink(c, sink).await;
    let console = s.app.console_addr.unwrap();
    let mut pay = event("payments", "pay-1", b"x");
    pay.max_attempts = 1;
    let mut req = Request::new(pb::EnqueueRequest { event: Some(pay) });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let id = s.client.clone().enqueue(req).await.unwrap().into_inner().id;
    eventually_status(&s, id, Status::Failed, "the payment failed").await;

    let get = |path: String, auth: String| async move {
        http(
            console,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"),
        )
        .await
    };
    let bearer = |t: &str| format!("Authorization: Bearer {t}\r\n");
    for path in [
        "/outbox/events?status=failed".to_string(),
        format!("/outbox/events/{id}"),
    ] {
        let r = get(path.clone(), bearer(VIEWER)).await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.contains("token viewer") && r.contains("read-only"),
            "{path}: {r}"
        );
        assert!(r.contains(&format!("{id}")), "{path}: {r}");
        assert!(
            !r.contains("value=\"requeue\"") && !r.contains("requeue-filter"),
            "{path}: a requeue form for a read-only token: {r}"
        );
        let r = get(path.clone(), bearer(TOKEN)).await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.contains("value=\"requeue\""),
            "{path}: the admin token's requeue form: {r}"
        );
    }
    let r = get("/audit".into(), bearer(VIEWER)).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");

    // The login form takes the read-only token; its session has no actions either.
    let form = format!("token={VIEWER}&next=/outbox/events");
    let r = http(
        console,
        &format!(
            "POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    let session = r
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie: "))
        .map(|l| &l["set-cookie: ".len()..])
        .and_then(|c| c.split(';').next())
        .unwrap_or_else(|| panic!("no session cookie: {r}"))
        .to_string();
    let r = get(
        "/outbox/events?status=failed".into(),
        format!("Cookie: {session}\r\n"),
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains("token viewer") && r.contains("read-only"),
        "{r}"
    );
    assert!(!r.contains("value=\"requeue\""), "{r}");

    let form = format!("action=requeue&id={id}&confirm=yes");
    let r = http(
        console,
        &format!(
            "POST /outbox/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {VIEWER}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        ),
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 403") && r.contains("admin_read"),
        "{r}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = s
        .app
        .store
        .get_event(BoxKind::Outbox, id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        e.status,
        Status::Failed,
        "the refused requeue changed nothing"
    );
    assert!(
        s.app
            .store
            .list_audit(10, None)
            .await
            .unwrap()
            .entries
            .is_empty(),
        "no audit entry"
    );
    s.app.stop().await.unwrap();
}

/// A console on a fresh database, no relays, with `tokens` (none: an open console).
async fn console_service(
    tokens: Vec<mailroom::access::TokenEntry>,
) -> (Service, std::net::SocketAddr) {
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relays = 0;
    c.console_listen = Some("127.0.0.1:0".parse().unwrap());
    c.tokens = tokens;
    let s = Service::start(c).await;
    let console = s.app.console_addr.unwrap();
    (s, console)
}

/// The `ops` token: the admin scope and enqueue.
fn ops_token() -> mailroom::access::TokenEntry {
    use mailroom::access::{Scope, TokenEntry};
    TokenEntry {
        name: "ops".into(),
        token: TOKEN.into(),
        certificate: None,
        scopes: vec![Scope::Admin, Scope::Enqueue],
        topics: None,
        subscriptions: None,
    }
}

/// A raw form POST to `path` with `headers` (each ending in `\r\n`).
fn form_post(path: &str, headers: &str, form: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    )
}

/// Issue 25, item 1: DNS rebinding, framing and sniffing, and `next` after login.
/// - On an open console (no token, the quick start), a hostile page that rebinds its
///   name to 127.0.0.1 posts with `Host` and `Origin` both its own: refused `421`, and
///   the event stays pending; reading a payload page the same way is refused too. The
///   same POST with the console's own `Host` acts (the check is not refusing everything).
///   Before: the cross-origin check compared `Origin` with `Host`, both the attacker's,
///   and the cancel went through.
/// - Every response carries the CSP (inline style and script by hash, `frame-ancestors
///   'none'`), `nosniff`, `Referrer-Policy: same-origin` and `no-store`.
/// - `next` after login stays on the console: `/\t/evil.test`, `//evil.test`,
///   `/\\evil.test` and `https://evil.test` all land on `/outbox`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebinding_framing_and_open_redirects_are_refused() {
    let (mut s, console) = console_service(Vec::new()).await;
    let port = console.port();
    let id = enqueue(&mut s.client, event("rebind", "k", b"secret payload")).await;
    let form = format!("action=cancel&id={id}&confirm=yes");
    let post = |host: String| {
        format!(
            "POST /outbox/events HTTP/1.1\r\nHost: {host}\r\nOrigin: http://{host}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
            form.len()
        )
    };
    let r = http(console, &post(format!("a.test:{port}"))).await;
    assert!(r.starts_with("HTTP/1.1 421"), "{r}");
    let r = http(
        console,
        &format!(
            "GET /outbox/events/{id} HTTP/1.1\r\nHost: a.test:{port}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 421") && !r.contains("secret payload"),
        "{r}"
    );
    assert_eq!(s.stored(BoxKind::Outbox, id).await.status, Status::Pending);
    // The console's own name acts: the refusal above was the host check.
    let r = http(console, &post(format!("localhost:{port}"))).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    eventually_status(
        &s,
        id,
        Status::Failed,
        "cancelled through the console's own name",
    )
    .await;

    // Headers on every response, pages and refusals alike.
    for req in [
        "GET /outbox HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_string(),
        format!("GET /outbox/events/{id} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        format!("GET /outbox HTTP/1.1\r\nHost: a.test:{port}\r\nConnection: close\r\n\r\n"),
    ] {
        let r = http(console, &req).await.to_ascii_lowercase();
        for h in [
            "content-security-policy: default-src 'none'; style-src 'sha256-",
            "frame-ancestors 'none'",
            "x-content-type-options: nosniff",
            "referrer-policy: same-origin",
            "cache-control: no-store",
        ] {
            assert!(r.contains(h), "{h} missing from {req}: {r}");
        }
    }

    // `next` stays on the console (an open console accepts any login token field).
    for next in [
        "/%09/evil.test",
        "//evil.test",
        "/%5Cevil.test",
        "https://evil.test",
        "/%0A/evil.test",
    ] {
        let r = http(
            console,
            &form_post("/login", "", &format!("token=&next={next}")),
        )
        .await;
        let location = r
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("location:"))
            .map(|l| l[9..].trim().to_string());
        assert!(
            location.as_deref().is_none_or(|l| l == "/outbox"),
            "next={next} redirected to {location:?}: {r}"
        );
    }
    s.app.stop().await.unwrap();
}

/// Issue 25, item 1: logins are rate-limited per address (5 failures a minute, then 429
/// even for the right token, until the minute ends); a resubmitted confirmation acts
/// once (the form's request id); the console's actions go through the gRPC request's own
/// validation (a 1,001-byte reason is refused, naming the field, and changes nothing).
/// Before: unlimited guesses; a reloaded confirmation acted again; any reason length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logins_are_limited_and_a_confirmation_acts_once() {
    let (s, console) = console_service(vec![ops_token()]).await;

    // A confirmation sent twice (the same form: the same request id) acts once.
    let mut client = s.client.clone();
    let mut enqueue = async |e: pb::Event| {
        client
            .enqueue(with_token(
                pb::EnqueueRequest { event: Some(e) },
                Some(TOKEN),
            ))
            .await
            .unwrap()
            .into_inner()
            .id
    };
    let id = enqueue(event("confirm", "k", b"x")).await;
    let auth = format!("Authorization: Bearer {TOKEN}\r\n");
    let post = |form: String| form_post("/outbox/events", &auth, &form);
    // The dry run renders the confirmation form with its request id.
    let dry = http(console, &post(format!("action=cancel&id={id}&reason=test"))).await;
    let rid = dry
        .split("name=\"request_id\" value=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or_else(|| panic!("no request id in the confirmation form: {dry}"))
        .to_string();
    let confirm = format!("action=cancel&id={id}&reason=test&confirm=yes&request_id={rid}");
    for _ in 0..2 {
        let r = http(console, &post(confirm.clone())).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }
    let audit = s.app.store.list_audit(10, None).await.unwrap();
    assert_eq!(audit.entries.len(), 1, "{:?}", audit.entries);

    // The gRPC validation: a reason over 1,000 bytes is refused and changes nothing.
    let other = enqueue(event("confirm", "k2", b"x")).await;
    let r = http(
        console,
        &post(format!(
            "action=cancel&id={other}&reason={}&confirm=yes",
            "r".repeat(1001)
        )),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 400") && r.contains("reason"), "{r}");
    assert_eq!(
        s.stored(BoxKind::Outbox, other).await.status,
        Status::Pending
    );

    // Last: once limited, this address's bearer requests are refused too.
    let login = |token: &str| form_post("/login", "", &format!("token={token}&next=/outbox"));
    for i in 0..5 {
        let r = http(console, &login(&format!("wrong-guess-{i}"))).await;
        assert!(r.starts_with("HTTP/1.1 401"), "guess {i}: {r}");
    }
    let r = http(console, &login("wrong-guess-5")).await;
    assert!(r.starts_with("HTTP/1.1 429"), "{r}");
    let r = http(console, &login(TOKEN)).await;
    assert!(
        r.starts_with("HTTP/1.1 429"),
        "the right token waits out the minute too: {r}"
    );
    s.app.stop().await.unwrap();
}

/// Issue 43, item 5: the login limit counts bearer attempts and cannot be raced.
/// - Bearer guesses (`Authorization` on any page) count with the login form's: of 8
///   wrong bearer tokens, 5 are answered 401 and 3 are 429; the login form is then 429
///   for this address, the right token too. Before: 8 × 401, and the form still
///   answered (bearer guesses were never counted).
/// - 20 wrong logins sent at once (their headers first, every body once all 20 are
///   waiting): 5 are 401, 15 are 429. Before: the limit was checked before the body was
///   read and counted after the answer, so all 20 were checked (20 × 401).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_login_limit_counts_bearer_guesses_and_cannot_be_raced() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (s, console) = console_service(vec![ops_token()]).await;
    let mut statuses = Vec::new();
    for i in 0..8 {
        let r = http(
            console,
            &format!(
                "GET /outbox HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong-guess-0000{i}\r\nConnection: close\r\n\r\n"
            ),
        )
        .await;
        statuses.push(r[9..12].to_string());
    }
    let r = http(
        console,
        &form_post("/login", "", &format!("token={TOKEN}&next=/outbox")),
    )
    .await;
    statuses.push(format!("login {}", &r[9..12]));
    assert_eq!(
        statuses,
        [
            "401",
            "401",
            "401",
            "401",
            "401",
            "429",
            "429",
            "429",
            "login 429"
        ],
        "bearer guesses count"
    );
    s.app.stop().await.unwrap();

    let (s, console) = console_service(vec![ops_token()]).await;
    let mut conns = Vec::new();
    for i in 0..20 {
        let form = format!("token=wrong-guess-{i:05}&next=/outbox");
        let request =
            form_post("/login", "", &form).replace("Host: x\r\n", &format!("Host: {console}\r\n"));
        let (head, body) = request.split_at(request.len() - form.len());
        let mut c = tokio::net::TcpStream::connect(console).await.unwrap();
        c.write_all(head.as_bytes()).await.unwrap();
        conns.push((c, body.to_string()));
    }
    // Every request is in the server, waiting for its body.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    for (c, body) in &mut conns {
        c.write_all(body.as_bytes()).await.unwrap();
    }
    let mut counts = std::collections::BTreeMap::new();
    for (mut c, _) in conns {
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        *counts.entry(out[9..12].to_string()).or_insert(0) += 1;
    }
    assert_eq!(
        counts,
        [("401".to_string(), 5), ("429".to_string(), 15)].into(),
        "concurrent guesses"
    );
    s.app.stop().await.unwrap();
}

/// Issue 43, item 5: logging out checks the origin like every other form post. A page
/// on another site posting to `/logout` (the cookie is `SameSite=Strict`, but not every
/// browser honours it, and a sibling site is same-site) is refused 403 and the session
/// stays; the console's own form (same origin, or no `Origin`) logs out. Before: the
/// cross-origin post answered 303 and ended the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logout_refuses_another_origin() {
    let (s, console) = console_service(vec![ops_token()]).await;
    let r = http(
        console,
        &form_post("/login", "", &format!("token={TOKEN}&next=/outbox")),
    )
    .await;
    let session = r
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie: "))
        .map(|l| &l["set-cookie: ".len()..])
        .and_then(|c| c.split(';').next())
        .unwrap_or_else(|| panic!("no session cookie: {r}"))
        .to_string();
    let page = |session: String| async move {
        let r = http(
            console,
            &format!(
                "GET /outbox HTTP/1.1\r\nHost: x\r\nCookie: {session}\r\nConnection: close\r\n\r\n"
            ),
        )
        .await;
        r[9..12].to_string()
    };
    assert_eq!(page(session.clone()).await, "200");
    let logout = |origin: &str| form_post("/logout", &format!("Cookie: {session}\r\n{origin}"), "");
    let r = http(console, &logout("Origin: http://evil.example\r\n")).await;
    let cross = (r[9..12].to_string(), page(session.clone()).await);
    let r = http(console, &logout(&format!("Origin: http://{console}\r\n"))).await;
    let own = (r[9..12].to_string(), page(session.clone()).await);
    assert_eq!(
        (cross, own),
        (
            ("403".to_string(), "200".to_string()),
            ("303".to_string(), "303".to_string())
        ),
        "(another origin: logout, then the page), (the console's own)"
    );
    s.app.stop().await.unwrap();
}

/// Issue 25, item 1 (slowloris): 50 connections send half a request line and stall. A
/// normal request is still answered at once, and the server closes every stalled
/// connection once its header-read timeout (`web::HEADER_READ_TIMEOUT`, 10 s) passes.
/// Before: `axum::serve` had no header timeout, and the stalled connections stayed open
/// for as long as their clients wanted. (The metrics server is served by the same code.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_are_closed_and_do_not_block_the_console() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (s, console) = console_service(Vec::new()).await;
    let mut stalled = Vec::new();
    for _ in 0..50 {
        let mut t = tokio::net::TcpStream::connect(console).await.unwrap();
        t.write_all(b"GET /outbox HTTP/1.1\r\nHo").await.unwrap();
        stalled.push(t);
    }
    let started = std::time::Instant::now();
    let r = http(
        console,
        "GET /outbox HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // Every stalled connection is closed by the server (EOF or reset), within the
    // timeout plus a margin.
    let deadline = Duration::from_secs(20);
    for (i, t) in stalled.iter_mut().enumerate() {
        let mut buf = [0u8; 512];
        let closed = tokio::time::timeout(deadline.saturating_sub(started.elapsed()), async {
            loop {
                match t.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "stalled connection {i} still open after {deadline:?}"
        );
    }
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "closed by the header timeout, not at once: {:?}",
        started.elapsed()
    );
    s.app.stop().await.unwrap();
}

/// Issue 25, item 1: behind a TLS proxy (`MAILROOM_CONSOLE_SECURE_COOKIE=true`) the
/// session cookie is `__Host-mailroom_session`, `Secure`, `Path=/`, no `Domain`, and it
/// is the one the console reads back; by default (plain HTTP on loopback) it is
/// `mailroom_session` without `Secure`, which browsers would not send over HTTP otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_cookie_is_secure_behind_tls() {
    for secure in [false, true] {
        let url = fresh_pg().await;
        let mut c = config(&url);
        c.relays = 0;
        c.console_listen = Some("127.0.0.1:0".parse().unwrap());
        c.console_secure_cookie = secure;
        c.tokens = vec![ops_token()];
        let s = Service::start(c).await;
        let console = s.app.console_addr.unwrap();
        let r = http(
            console,
            &form_post("/login", "", &format!("token={TOKEN}&next=/outbox")),
        )
        .await;
        let set = r
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
            .unwrap_or_else(|| panic!("no cookie: {r}"))
            .to_string();
        let pair = set[11..].trim().split(';').next().unwrap().to_string();
        if secure {
            assert!(pair.starts_with("__Host-mailroom_session="), "{set}");
            assert!(set.contains("; Secure") && set.contains("Path=/"), "{set}");
            assert!(!set.to_ascii_lowercase().contains("domain="), "{set}");
        } else {
            assert!(pair.starts_with("mailroom_session="), "{set}");
            assert!(!set.contains("Secure"), "{set}");
        }
        let page = http(
            console,
            &format!(
                "GET /outbox HTTP/1.1\r\nHost: x\r\nCookie: {pair}\r\nConnection: close\r\n\r\n"
            ),
        )
        .await;
        assert!(
            page.starts_with("HTTP/1.1 200"),
            "the cookie logs in: {page}"
        );
        s.app.stop().await.unwrap();
    }
}

/// Issue 44, item 1: a completed outbox event is republished from the console, from its
/// page or the completed list, with a dry run first; the copy names its original and the
/// resubmitted confirmation acts once. Pending events get no republish button.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_republishes_completed_events() {
    let url = fresh_pg().await;
    let out = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    c.relays = 1;
    c.console_listen = Some("127.0.0.1:0".parse().unwrap());
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(out.path().join("sink.jsonl")),
    };
    let mut s = Service::start(c).await;
    let console = s.app.console_addr.unwrap();
    let mut e = event("again", "k", b"x");
    e.headers.insert("trace".into(), "t-1".into());
    let id = enqueue(&mut s.client, e).await;
    wait_completed(&s.app.store, 1, Duration::from_secs(20)).await;
    let get = |path: String| async move {
        http(
            console,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
        .await
    };
    let r = get(format!("/outbox/events/{id}")).await;
    assert!(r.contains("republish-one"), "{r}");
    let r = get("/outbox/events?status=completed".into()).await;
    assert!(r.contains("republish-selected"), "{r}");
    let r = get("/outbox/events?status=pending".into()).await;
    assert!(!r.contains("republish-selected"), "{r}");
    // The events page finds an event by a header (issue 44, item 5).
    let r = get("/outbox/events?status=any&header=trace%3Dt-1".into()).await;
    assert!(r.contains(&format!("sel-{id}")), "{r}");
    let r = get("/outbox/events?status=any&header=trace%3Dt-2".into()).await;
    assert!(!r.contains(&format!("sel-{id}")), "{r}");

    let post = |form: String| async move {
        http(
            console,
            &format!(
                "POST /outbox/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
                form.len()
            ),
        )
        .await
    };
    let r = post(format!("action=republish&id={id}")).await;
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains("This would <strong>republish</strong>"),
        "{r}"
    );
    assert_eq!(s.outbox_count(None).await, 1, "a dry run stores nothing");
    let confirm = format!("action=republish&id={id}&confirm=yes&request_id=console-1");
    for _ in 0..2 {
        let r = post(confirm.clone()).await;
        assert!(r.starts_with("HTTP/1.1 200") && r.contains("Done:"), "{r}");
    }
    assert_eq!(
        s.outbox_count(None).await,
        2,
        "the resubmitted form acts once"
    );
    wait_completed(&s.app.store, 2, Duration::from_secs(20)).await;
    let copy = s
        .app
        .store
        .list_events(
            BoxKind::Outbox,
            &mailroom::domain::admin::EventsQuery {
                status: None,
                filter: Default::default(),
                page_size: 10,
                before_id: None,
            },
        )
        .await
        .unwrap()
        .events[0]
        .event
        .clone();
    assert!(copy.id > id);
    assert_eq!(
        copy.headers.get("mailroom-republished-from"),
        Some(&id.to_string())
    );
    s.app.stop().await.unwrap();
}

/// Issue 44, item 2: an inbox subscription is paused and resumed from its console page;
/// the page shows the pause, and the pause is the same one the RPCs see. The same page
/// rewinds the subscription (a dry run, then the rewind asked for once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_pauses_and_resumes_a_subscription() {
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relays = 0;
    c.console_listen = Some("127.0.0.1:0".parse().unwrap());
    let handler = format!("http://127.0.0.1:{}", free_port());
    c.subscriptions = vec![crate::support::subscription("billing", &[], &handler)];
    let s = Service::start(c).await;
    let console = s.app.console_addr.unwrap();
    let get = || async move {
        http(
            console,
            "GET /inbox/billing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await
    };
    let post = |form: &'static str| async move {
        http(
            console,
            &format!(
                "POST /inbox/billing HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
                form.len()
            ),
        )
        .await
    };
    let r = get().await;
    assert!(
        r.contains("pause-subscription") && !r.contains("is paused"),
        "{r}"
    );
    let r = post("action=pause&reason=handler+deploy").await;
    assert!(r.starts_with("HTTP/1.1 303"), "{r}");
    let r = get().await;
    assert!(
        r.contains("This subscription is paused") && r.contains("handler deploy"),
        "{r}"
    );
    assert!(r.contains("resume-subscription"), "{r}");
    let mut a = pb::admin_service_client::AdminServiceClient::new(channel(s.app.addr).await);
    let listed = a
        .list_paused_subscriptions(pb::ListPausedSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.subscriptions.len(), 1);
    assert_eq!(listed.subscriptions[0].reason, "handler deploy");
    let r = post("action=resume").await;
    assert!(r.starts_with("HTTP/1.1 303"), "{r}");
    let r = get().await;
    assert!(!r.contains("This subscription is paused"), "{r}");

    // A rewind from the same page: the dry run's count, then the confirmed rewind (sent
    // twice, asked once), the same one ListRewinds sees.
    assert!(r.contains("rewind-subscription"), "{r}");
    let r = post("action=rewind&to=2026-12-01T10%3A00&redeliver=yes").await;
    assert!(
        r.starts_with("HTTP/1.1 200")
            && r.contains("message(s) stored since then")
            && r.contains("as a new message"),
        "{r}"
    );
    assert!(
        s.app
            .store
            .rewinds(Some("billing"), None, 10)
            .await
            .unwrap()
            .is_empty(),
        "a dry run asks nothing"
    );
    for _ in 0..2 {
        let r = post(
            "action=rewind&to=2026-12-01T10%3A00&redeliver=yes&confirm=yes&request_id=console-rw-1",
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 303"), "{r}");
    }
    let rewinds = s
        .app
        .store
        .rewinds(Some("billing"), None, 10)
        .await
        .unwrap();
    assert_eq!(rewinds.len(), 1, "{rewinds:?}");
    assert!(
        rewinds[0].redeliver
            && rewinds[0]
                .to_time
                .to_rfc3339()
                .starts_with("2026-12-01T10:00:00"),
        "{rewinds:?}"
    );
    let r = post("action=rewind&to=not-a-time").await;
    assert!(r.contains("to_time"), "{r}");
    s.app.stop().await.unwrap();
}

/// Issue 44, item 5: the rate chart reads deliveries per minute kept in the database, so
/// a replica shows what another one delivered, and a restart keeps the history: one
/// service publishes 5 events and stops (its last flush), a second one on the same
/// database, with no relay, shows 5 in its chart. Both engines keep the counts (a store
/// check: two additions to one minute sum, old rows are pruned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_chart_is_the_same_on_every_replica() {
    let url = fresh_pg().await;
    let out = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(out.path().join("sink.jsonl")),
    };
    let mut a = Service::start(c).await;
    for i in 0..5 {
        enqueue(
            &mut a.client,
            event("rates.t", "k", format!("{i}").as_bytes()),
        )
        .await;
    }
    wait_completed(&a.app.store, 5, Duration::from_secs(20)).await;
    a.app.stop().await.unwrap();

    let mut c = config(&url);
    c.relays = 0;
    c.console_listen = Some("127.0.0.1:0".parse().unwrap());
    let b = Service::start(c).await;
    let console = b.app.console_addr.unwrap();
    let r = http(
        console,
        "GET /outbox HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        r.contains("<strong class=\"rate-total\">5</strong>"),
        "the other replica's 5 deliveries: {r}"
    );
    b.app.stop().await.unwrap();

    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let s = Service::start(quiet_config(&url)).await;
        let count = |minute, n| mailroom::domain::admin::RateCount {
            box_kind: BoxKind::Inbox,
            subscription: "billing".into(),
            minute,
            n,
        };
        let st = &s.app.store;
        st.add_rates(&[count(100, 2), count(500, 1)], 0)
            .await
            .unwrap();
        st.add_rates(&[count(500, 3)], 200).await.unwrap();
        assert_eq!(
            st.rates(BoxKind::Inbox, "billing", 0).await.unwrap(),
            [(500, 4)],
            "{engine:?}: summed, and minute 100 pruned"
        );
        assert!(st.rates(BoxKind::Outbox, "", 0).await.unwrap().is_empty());
        s.app.stop().await.unwrap();
    }
}

/// Issue 44, item 4: the jobs page. A start form's dry run shows the count and changes
/// nothing; its confirmation starts one job (sent twice, still one); the page lists the
/// job with its progress and state; a running job's cancel button stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_starts_follows_and_cancels_jobs() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.console_listen = Some("127.0.0.1:0".parse().unwrap());
    // Slow pages, so the second job is still running when it is cancelled.
    c.jobs.page_pause = Duration::from_secs(2);
    let mut s = Service::start(c).await;
    let console = s.app.console_addr.unwrap();
    let events: Vec<pb::Event> = (0..1500)
        .map(|i| event("jobs.console", &format!("k{}", i % 10), b"x"))
        .collect();
    enqueue_in_batches(&mut s, &events).await;
    let get = || async move {
        http(
            console,
            "GET /jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await
    };
    let post = |form: String| async move {
        http(
            console,
            &format!(
                "POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
                form.len()
            ),
        )
        .await
    };
    let r = get().await;
    assert!(
        r.starts_with("HTTP/1.1 200") && r.contains("No jobs yet."),
        "{r}"
    );
    let form = "action=start&kind=cancel&box=outbox&topic=jobs.console&reason=bad+batch";
    let r = post(form.to_string()).await;
    assert!(
        r.contains("would select <strong>1500</strong> event(s)") && r.contains("Start the job"),
        "{r}"
    );
    assert_eq!(
        s.outbox_count(Some(Status::Failed)).await,
        0,
        "a dry run changes nothing"
    );
    for _ in 0..2 {
        let r = post(format!("{form}&confirm=yes&request_id=console-job-1")).await;
        assert!(r.starts_with("HTTP/1.1 303"), "{r}");
    }
    eventually(Duration::from_secs(30), "the cancel job done", || async {
        s.outbox_count(Some(Status::Failed)).await == 1500
    })
    .await;
    let jobs = s.app.store.jobs(10, None).await.unwrap();
    assert_eq!(jobs.len(), 1, "the form sent twice started one job");
    eventually(
        Duration::from_secs(10),
        "the job shown completed",
        || async {
            let r = get().await;
            r.contains("job-completed") && r.contains("1500</span> / 1500")
        },
    )
    .await;
    // A requeue job with 2 s between pages: cancelled after its first page.
    let r = post("action=start&kind=requeue&box=outbox&topic=jobs.console&confirm=yes&request_id=console-job-2".into()).await;
    assert!(r.starts_with("HTTP/1.1 303"), "{r}");
    let id = s.app.store.jobs(1, None).await.unwrap()[0].id;
    eventually(Duration::from_secs(10), "the first page done", || async {
        s.app.store.job(id).await.unwrap().unwrap().done == 1000
    })
    .await;
    let r = get().await;
    assert!(
        r.contains("job-running") && r.contains("name=\"action\" value=\"cancel\""),
        "{r}"
    );
    let r = post(format!("action=cancel&id={id}")).await;
    assert!(r.starts_with("HTTP/1.1 303"), "{r}");
    eventually(Duration::from_secs(10), "the job cancelled", || async {
        s.app.store.job(id).await.unwrap().unwrap().state
            == mailroom::domain::jobs::JobState::Cancelled
    })
    .await;
    assert_eq!(
        s.outbox_count(Some(Status::Failed)).await,
        500,
        "one page requeued, then it stopped"
    );
    let r = get().await;
    assert!(r.contains("job-cancelled"), "{r}");
    s.app.stop().await.unwrap();
}
