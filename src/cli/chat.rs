//! `dflash2 chat`: an interactive conversation, kept in the engine's cache between turns.
//!
//! Each turn renders the whole conversation with the target's chat template; the engine
//! reuses the cached prefix, so only the new turn is decoded.
use crate::text::Utf8Stream;
use crate::engine::{Engine, FinishReason, GenerateOptions, Stats};
use crate::llama::ChatMessage;
use crate::template::ChatTemplate;
use rustyline::error::ReadlineError;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub engine: super::EngineArgs,
    /// System message at the start of the conversation (kept by /reset).
    #[arg(long)]
    pub system: Option<String>,
    /// Tokens per reply at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    pub n_predict: usize,
}

pub fn run(args: &ChatArgs) -> anyhow::Result<()> {
    let engine = args.engine.load()?;
    let template = args.engine.models.template.load(engine.model())?;
    let opts = args.engine.options(&engine, args.n_predict, Vec::new())?;

    // Ctrl-C during a reply stops the reply; at the prompt the terminal is in raw mode, so
    // rustyline reads it as a key instead and no signal arrives.
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))?;

    let mut chat = Chat { engine, template, opts, system: args.system.clone(), messages: Vec::new(), last: None };
    chat.reset()?;
    let mut editor = rustyline::DefaultEditor::new()?;
    eprintln!("dflash2 chat: /reset forgets the conversation, /stats shows the last reply's statistics, /quit leaves");
    eprintln!("(Ctrl-C stops a reply, Ctrl-D leaves)");
    loop {
        let line = match editor.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        editor.add_history_entry(line)?;
        match line {
            "/quit" | "/exit" => return Ok(()),
            "/reset" => {
                chat.reset()?;
                eprintln!("(conversation forgotten)");
            }
            "/stats" => chat.print_stats(),
            cmd if cmd.starts_with('/') => eprintln!("unknown command {cmd}: /reset, /stats or /quit"),
            text => {
                interrupted.store(false, Ordering::SeqCst);
                if let Err(e) = chat.reply(text, &interrupted) {
                    eprintln!("error: {e:#}");
                }
            }
        }
    }
}

struct Chat {
    engine: Engine,
    template: ChatTemplate,
    opts: GenerateOptions,
    system: Option<String>,
    messages: Vec<ChatMessage>,
    last: Option<(Stats, FinishReason)>,
}

impl Chat {
    fn reset(&mut self) -> anyhow::Result<()> {
        self.engine.reset()?;
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        self.last = None;
        Ok(())
    }

    /// Answer `text`, streaming the reply; a failed turn leaves the conversation as it was.
    fn reply(&mut self, text: &str, interrupted: &AtomicBool) -> anyhow::Result<()> {
        self.messages.push(ChatMessage { role: "user".into(), content: text.into() });
        let answer = self.generate(interrupted);
        if answer.is_err() {
            self.messages.pop();
        }
        let answer = answer?;
        self.messages.push(ChatMessage { role: "assistant".into(), content: answer });
        Ok(())
    }

    fn generate(&mut self, interrupted: &AtomicBool) -> anyhow::Result<String> {
        let model = self.engine.model().clone();
        let prompt = self.template.tokens(&model, &self.messages)?;
        let mut stdout = std::io::stdout().lock();
        let mut utf8 = Utf8Stream::default();
        let gen = self.engine.generate(&prompt, &self.opts, |tokens| {
            let bytes: Vec<u8> = tokens.iter().flat_map(|&t| model.token_bytes(t, false)).collect();
            let _ = stdout.write_all(utf8.push(&bytes).as_bytes());
            let _ = stdout.flush();
            !interrupted.load(Ordering::SeqCst)
        })?;
        writeln!(stdout, "{}", utf8.finish())?;
        let s = &gen.stats;
        let note = match gen.finish {
            FinishReason::Cancelled => ", stopped",
            FinishReason::Length => ", cut at --n-predict",
            FinishReason::Context => ", the context is full: /reset to go on",
            FinishReason::Eog | FinishReason::Stop => "",
        };
        eprintln!("[{} tokens, {:.1} tok/s, tau {:.2}{note}]", s.n_generated, s.tokens_per_second(), s.tau());
        self.last = Some((gen.stats, gen.finish));
        Ok(gen.text)
    }

    fn print_stats(&self) {
        let Some((s, finish)) = &self.last else {
            eprintln!("no reply yet");
            return;
        };
        eprintln!(
            "last reply: {} tokens in {} cycles, tau {:.2}, {:.1} tok/s, finish: {finish:?}",
            s.n_generated,
            s.cycles,
            s.tau(),
            s.tokens_per_second()
        );
        eprintln!(
            "prompt: {} tokens, {} decoded, {} from the cache",
            s.n_prompt,
            s.n_prompt_decoded,
            s.n_prompt - s.n_prompt_decoded
        );
        eprintln!(
            "drafts: {} drafted, {} accepted; prefill {:.0} ms, draft {:.0} ms, verify {:.0} ms",
            s.n_drafted, s.n_draft_accepted, s.prefill_ms, s.draft_ms, s.verify_ms
        );
        eprintln!(
            "conversation: {} messages, {} of {} context tokens cached",
            self.messages.len(),
            self.engine.cached_tokens().len(),
            self.engine.n_ctx()
        );
    }
}
