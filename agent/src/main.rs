//! The pdpair-agent command line. Logic lives in the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pdpair_agent::cli;

#[derive(Debug, Parser)]
#[command(name = "pdpair-agent", version, about = "pdpair node agent")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the KV checksum of each block of a dump in the canonical layout, one per line.
    Checksum(cli::ChecksumArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Checksum(args) => {
            let stdout = std::io::stdout();
            match cli::checksum(&args, &mut stdout.lock()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}
