//! `deepep-nix` entry point: parse arguments, run, map errors to exit codes
//! (2 for verification failures and usage errors, 1 for other failures).

use std::io::IsTerminal;

use clap::Parser;
use deepep_nix::cli::{self, Cli};

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DEEPEP_NIX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_target(false)
        .without_time()
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let cli = Cli::parse();
    let code = match cli::run(&cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", deepep_nix::error::chain_message(&e));
            e.downcast_ref::<deepep_nix::Error>()
                .map_or(1, deepep_nix::Error::exit_code)
        }
    };
    std::process::exit(code);
}
