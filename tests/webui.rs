//! The chat page at `/`, in a real browser: headless Chromium driven through chromedriver
//! (WebDriver's JSON over HTTP, sent with curl). The page loads, a message typed into it gets
//! an answer that streams in, and the answer's stats (tokens/s, tau, tokens by source) appear;
//! a screenshot is kept at `target/webui/chat.png`. `tests/support/setup.sh` installs Chromium
//! and chromedriver; without them this test fails, it is never skipped.
mod common;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// curl, never through a proxy: (status, body).
fn curl(method: &str, url: &str, body: Option<&Value>) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--noproxy", "*", "--max-time", "120", "-w", "\n%{http_code}", "-X", method, url]);
    if let Some(b) = body {
        cmd.args(["-H", "Content-Type: application/json", "-d", &b.to_string()]);
    }
    let out = cmd.output().expect("curl is installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|f| f.is_file()))
}

/// chromedriver on a free port, killed when dropped, with one headless Chromium session.
struct Browser {
    driver: Child,
    base: String,
    session: String,
}

impl Browser {
    fn start() -> Browser {
        let missing = "is missing: run `bash tests/support/setup.sh` (it installs Debian's chromium and chromium-driver)";
        let driver = on_path("chromedriver").unwrap_or_else(|| panic!("chromedriver {missing}"));
        let chromium = ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|n| on_path(n)).unwrap_or_else(|| panic!("Chromium {missing}"));
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log = common::scratch_dir("server-logs").join("chromedriver.log");
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start chromedriver");
        let mut browser = Browser { driver: child, base: format!("http://127.0.0.1:{port}"), session: String::new() };
        let deadline = Instant::now() + Duration::from_secs(30);
        while curl("GET", &format!("{}/status", browser.base), None).0 != 200 {
            assert!(Instant::now() < deadline, "chromedriver did not start; log: {}", log.display());
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({ "capabilities": { "alwaysMatch": { "browserName": "chrome", "goog:chromeOptions": {
            "binary": chromium, "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,760"] } } } });
        let (code, text) = curl("POST", &format!("{}/session", browser.base), Some(&caps));
        assert_eq!(code, 200, "no browser session: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        browser.session = v["value"]["sessionId"].as_str().unwrap().to_string();
        browser
    }

    /// One WebDriver command of this session; its `value`.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let (code, text) = curl(method, &url, body.as_ref());
        assert_eq!(code, 200, "{method} {path}: {text}");
        serde_json::from_str::<Value>(&text).unwrap()["value"].take()
    }

    fn script(&self, script: &str) -> Value {
        self.call("POST", "/execute/sync", Some(json!({ "script": script, "args": [] })))
    }

    fn element(&self, css: &str) -> String {
        let v = self.call("POST", "/element", Some(json!({ "using": "css selector", "value": css })));
        v.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).unwrap().to_string()
    }

    /// The page as a PNG at `path`.
    fn screenshot(&self, path: &Path) {
        let encoded = self.call("GET", "/screenshot", None);
        let mut decode = Command::new("base64").arg("-d").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("base64");
        std::io::Write::write_all(&mut decode.stdin.take().unwrap(), encoded.as_str().unwrap().as_bytes()).unwrap();
        let png = decode.wait_with_output().unwrap().stdout;
        assert!(png.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = curl("DELETE", &format!("{}/session/{}", self.base, self.session), None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

#[test]
fn the_chat_page_streams_an_answer_with_its_stats_in_a_real_browser() {
    let model = common::real_model(common::SMOLLM2);
    let drafter = common::shipped_drafter();
    let server = common::Server::spawn(
        "webui",
        &["-m", model.to_str().unwrap(), "-t", "1", "--drafter", drafter.to_str().unwrap(), "--lookup", "-n", "64"],
    );
    let browser = Browser::start();
    browser.call("POST", "/url", Some(json!({ "url": format!("{}/", server.base) })));
    assert_eq!(browser.script("return document.title"), "dflash2");

    // Count the answer's updates as they land: a streamed answer grows in several.
    browser.script(
        "window.updates = 0; new MutationObserver(() => window.updates++)
           .observe(document.getElementById('log'), { subtree: true, childList: true, characterData: true });",
    );
    let input = browser.element("#input");
    browser.call("POST", &format!("/element/{input}/value"), Some(json!({ "text": "Write a short poem about the sea." })));
    let send = browser.element("#send");
    browser.call("POST", &format!("/element/{send}/click"), Some(json!({})));

    let deadline = Instant::now() + Duration::from_secs(120);
    let stats = loop {
        let v = browser.script(
            "const s = document.querySelector('.stats'); if (!s) return null;
             const out = {}; s.querySelectorAll('b').forEach(b => out[b.dataset.stat] = Number(b.textContent));
             return { stats: out, answer: document.querySelector('.answer').textContent, user: document.querySelector('.user').textContent,
                      updates: window.updates, sending: document.getElementById('send').disabled };",
        );
        if !v.is_null() {
            break v;
        }
        assert!(Instant::now() < deadline, "no stats appeared");
        std::thread::sleep(Duration::from_millis(200));
    };
    let shot = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/webui/chat.png");
    browser.screenshot(&shot);
    eprintln!("the chat page's screenshot: {}", shot.display());

    assert_eq!(stats["user"], "Write a short poem about the sea.");
    let answer = stats["answer"].as_str().unwrap();
    assert!(!answer.trim().is_empty() && !answer.contains("Error"), "{stats}");
    assert!(stats["updates"].as_u64().unwrap() > 4, "the answer did not stream in: {stats}");
    let n = |name: &str| stats["stats"][name].as_f64().unwrap_or_else(|| panic!("no {name} shown: {stats}"));
    assert!(n("tokens") > 0.0 && n("tok/s") > 0.0 && n("tau") >= 1.0, "{stats}");
    assert_eq!(n("accepted"), n("from drafter") + n("from look-up"), "{stats}");
    assert!(n("drafted") >= n("accepted"), "{stats}");
    assert_eq!(stats["sending"], false, "the page is ready for the next message");

    // The page is the server's own: the same answer as the API gives for the same message.
    let api = curl("POST", &format!("{}/v1/chat/completions", server.base),
        Some(&json!({ "messages": [{ "role": "user", "content": "Write a short poem about the sea." }] })));
    let api: Value = serde_json::from_str(&api.1).unwrap();
    assert_eq!(api["choices"][0]["message"]["content"].as_str(), Some(answer));

    // `--no-webui` leaves the page out.
    let bare = common::Server::spawn("webui-off", &["-m", model.to_str().unwrap(), "-t", "1", "--no-webui"]);
    assert_eq!(curl("GET", &format!("{}/", bare.base), None).0, 404);
    assert_eq!(curl("GET", &format!("{}/", server.base), None).0, 200);
}
