//! `dflash2 chat` driven through a real terminal (tmux) with the real Qwen2.5-Coder target:
//! turns stream and keep the conversation in the cache, /stats and /reset work, and Ctrl-C
//! stops a reply without leaving the chat.
mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Replies are cut at this many tokens: the short answers end long before, and the essay
/// runs long enough for Ctrl-C to land during it even on a fast machine.
const N_PREDICT: &str = "512";

/// A private tmux server (its own socket) running one chat; killed on drop.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start(command: &[&str]) -> Self {
        let version = Command::new("tmux").arg("-V").output();
        assert!(
            version.as_ref().is_ok_and(|o| o.status.success()),
            "tmux is needed to drive the chat through a terminal: apt-get install -y tmux ({version:?})"
        );
        let t = Tmux { socket: format!("dflash2-chat-test-{}", std::process::id()) };
        // A shell prints the chat's exit status (tmux's #{pane_dead_status} is sometimes
        // empty) and the pane stays after that. The shell's no-op trap keeps it alive through
        // the Ctrl-C meant for the chat; a trap, unlike an ignored signal, is not inherited.
        let wrapper = r#"trap : INT; "$@"; echo "[chat exited: $?]""#;
        let mut args = vec!["-f", "/dev/null", "new-session", "-d", "-s", "chat", "-x", "200", "-y", "50"];
        args.extend_from_slice(&["sh", "-c", wrapper, "sh"]);
        args.extend_from_slice(command);
        args.extend_from_slice(&[";", "set-option", "-w", "-t", "chat", "remain-on-exit", "on"]);
        t.run(&args);
        t
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = Command::new("tmux").arg("-L").arg(&self.socket).args(args).output().unwrap();
        assert!(out.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out
    }

    /// The whole pane, scrollback included, wrapped lines joined.
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-J", "-S", "-", "-t", "chat"]).stdout).into_owned()
    }

    fn send_line(&self, text: &str) {
        self.run(&["send-keys", "-t", "chat", "-l", text]);
        self.run(&["send-keys", "-t", "chat", "Enter"]);
    }

    fn ctrl_c(&self) {
        self.run(&["send-keys", "-t", "chat", "C-c"]);
    }

    /// Poll the screen until `done` holds; fail with the screen after `secs`.
    fn wait(&self, what: &str, secs: u64, done: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let screen = self.screen();
            if done(&screen) {
                return screen;
            }
            assert!(!screen.contains("[chat exited"), "the chat exited while waiting for {what}; screen:\n{screen}");
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "timed out after {secs} s waiting for {what}; screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait until `n` replies have finished and the prompt is back.
    fn wait_replies(&self, n: usize) -> String {
        self.wait(&format!("reply {n} and the prompt"), 180, |s| summaries(s).len() == n && at_prompt(s))
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let tmux = |args: &[&str]| Command::new("tmux").arg("-L").arg(&self.socket).args(args).output();
        // The server leaves its socket file behind.
        let socket = tmux(&["display-message", "-p", "#{socket_path}"]);
        let _ = tmux(&["kill-server"]);
        if let Ok(out) = socket {
            let _ = std::fs::remove_file(String::from_utf8_lossy(&out.stdout).trim());
        }
    }
}

fn lines(screen: &str) -> Vec<&str> {
    screen.lines().map(str::trim_end).filter(|l| !l.is_empty()).collect()
}

fn at_prompt(screen: &str) -> bool {
    lines(screen).last() == Some(&">")
}

/// The one-line summaries printed after each reply.
fn summaries(screen: &str) -> Vec<&str> {
    lines(screen).into_iter().filter(|l| l.starts_with('[') && l.contains(" tok/s, tau ")).collect()
}

/// (prompt tokens, decoded) from the latest /stats.
fn last_prompt_stats(screen: &str) -> (usize, usize) {
    let line = lines(screen).into_iter().rev().find(|l| l.starts_with("prompt: ")).expect("a /stats prompt line");
    let nums: Vec<usize> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    assert_eq!(nums.len(), 3, "{line}");
    assert_eq!(nums[0], nums[1] + nums[2], "{line}");
    (nums[0], nums[1])
}

/// Send /stats and read the new report.
fn stats(t: &Tmux) -> (usize, usize) {
    let before = t.screen().matches("conversation: ").count();
    t.send_line("/stats");
    let screen = t.wait("/stats", 30, |s| s.matches("conversation: ").count() > before && at_prompt(s));
    last_prompt_stats(&screen)
}

/// The reply text printed after the input line `question` (its `nth` occurrence).
fn reply_to(screen: &str, question: &str, nth: usize) -> String {
    let ls = lines(screen);
    let asked = format!("> {question}");
    let start = ls.iter().enumerate().filter(|(_, l)| **l == asked).nth(nth).expect("the question on screen").0;
    ls[start + 1..]
        .iter()
        .take_while(|l| !(l.starts_with('[') && l.contains(" tok/s, tau ")))
        .copied()
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn chat_keeps_the_conversation_cached_and_survives_ctrl_c() {
    let target = common::real_model(common::QWEN_05B);
    let dir = common::scratch_dir("chat-qwen");
    let drafter = dflash2::gguf::synth::synth_for_target(&target, &dir, 0).expect("synth --target").path;
    let (target, drafter) = (target.to_str().unwrap(), drafter.to_str().unwrap());
    let t = Tmux::start(&[
        env!("CARGO_BIN_EXE_dflash2"),
        "chat",
        "-m",
        target,
        "-d",
        drafter,
        "-n",
        N_PREDICT,
        "--block",
        "4",
        "-c",
        "2048",
        "--system",
        "You are a terse assistant.",
    ]);
    t.wait("the first prompt", 180, at_prompt);

    // Turn 1 decodes its whole prompt.
    let q1 = "What is 2+2? Answer with one number.";
    t.send_line(q1);
    let screen = t.wait_replies(1);
    let first_answer = reply_to(&screen, q1, 0);
    assert!(first_answer.contains('4'), "{screen}");
    let (p1, d1) = stats(&t);
    assert_eq!(d1, p1, "a fresh conversation decodes its whole prompt");

    // Turn 2 re-renders the conversation, but the cache holds turn 1: it is not decoded again.
    t.send_line("And 3+3? Answer with one number.");
    t.wait_replies(2);
    let (p2, d2) = stats(&t);
    assert!(p2 > p1, "turn 2's prompt holds turn 1: {p2} vs {p1}");
    assert!(p2 - d2 >= p1, "turn 2 decoded {d2} of {p2} tokens: turn 1's {p1} should all come from the cache");

    // /reset forgets it but keeps the system message: the same prompt is decoded from
    // scratch and answered the same.
    t.send_line("/reset");
    t.wait("/reset", 30, |s| s.contains("(conversation forgotten)") && at_prompt(s));
    t.send_line(q1);
    let screen = t.wait_replies(3);
    assert_eq!(reply_to(&screen, q1, 1), first_answer);
    assert_eq!(stats(&t), (p1, p1));

    // Ctrl-C during a long reply stops it and returns to the prompt.
    let essay = "Write a long, detailed essay about the history of computers.";
    t.send_line(essay);
    t.wait("the essay to start streaming", 120, |s| !reply_to(s, essay, 0).trim().is_empty());
    t.ctrl_c();
    let screen = t.wait_replies(4);
    let summary = summaries(&screen)[3];
    assert!(summary.contains("stopped"), "Ctrl-C should stop the reply: {summary}\n{screen}");

    // The chat goes on.
    t.send_line("What is 5+5? Answer with one number.");
    let screen = t.wait_replies(5);
    assert!(!summaries(&screen)[4].contains("stopped"), "{screen}");

    t.send_line("/quit");
    let t0 = Instant::now();
    while !t.screen().contains("[chat exited") {
        assert!(t0.elapsed() < Duration::from_secs(30), "/quit did not exit; screen:\n{}", t.screen());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(t.screen().contains("[chat exited: 0]"), "{}", t.screen());
}
