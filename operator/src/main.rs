//! The pdpair-operator command line. Logic lives in the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use pdpair_operator::{crd, run, validate};

#[derive(Debug, Parser)]
#[command(
    name = "pdpair-operator",
    version,
    about = "Operator for PDPair prefill/decode pairs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the admission webhook, the controller and the admin port.
    Run(Box<run::RunOptions>),
    /// Print the CRDs as YAML.
    Crd,
    /// Check PDPair manifests with the rule table: exit 0 when all are admitted, 1 when any is
    /// rejected, 2 when an input cannot be read or is not a valid PDPair.
    Validate {
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        /// YAML files, each with one or more documents; `-` reads standard input.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<String>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Output {
    Text,
    Json,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run(opts) => {
            run::init_logging(opts.log_format);
            let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: starting the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(run::run(*opts)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Crd => {
            print!("{}", crd::stream());
            ExitCode::SUCCESS
        }
        Command::Validate { output, files } => {
            let report = validate::run(&files);
            eprint!("{}", report.notes());
            match output {
                Output::Text => print!("{}", report.to_text()),
                Output::Json => print!("{}", report.to_json()),
            }
            ExitCode::from(report.exit_code())
        }
    }
}
