use clap::Parser;

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,llama-cpp-2=error".into()),
        )
        .init();
    let cli = dflash2::cli::Cli::parse_from(dflash2::cli::llama_style_args(std::env::args_os()));
    if let Err(e) = dflash2::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
