//! The `grpo-cli` binary: train language models with GRPO on candle.
//!
//! Subcommands arrive with the crates they drive (see README.md): `generate`, `logprobs` and
//! `init-model` drive the policy model (grpo-rollout); `advantages` computes GRPO advantages
//! from rewards given on the command line (grpo-core); `data` inspects and synthesises datasets
//! (grpo-data).

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use grpo_core::advantages::{ScaleRewards, group_advantages, leave_one_out_advantages};

mod bench_cmd;
mod data_cmd;
mod env_cmd;
mod import_cmd;
mod model_cmd;
mod score_cmd;
mod train_cmd;

/// Train language models with GRPO (plus SFT and DPO) on candle: one fast binary.
#[derive(Debug, Parser)]
#[command(name = "grpo-cli", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Sample completions from a model (HF directory or .gguf file).
    Generate(model_cmd::GenerateArgs),
    /// Log-probs of a completion's tokens given a prompt.
    Logprobs(model_cmd::LogprobsArgs),
    /// Render a conversation with a model's (or a file's) chat template, as transformers does.
    ChatTemplate(model_cmd::ChatTemplateArgs),
    /// Write a random-weight model directory (byte-level BPE tokenizer, ChatML template).
    InitModel(model_cmd::InitModelArgs),
    /// Export a checkpoint as a Hugging Face model directory (LoRA adapters merged).
    Export(model_cmd::ExportArgs),
    /// Merge models with mergekit's methods from its YAML (or TOML) configuration.
    Merge(model_cmd::MergeArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (completions, chat, LoRA adapters).
    Serve(model_cmd::ServeArgs),
    /// Benchmark generation and forward + backward of a model (JSON line).
    BenchModel(bench_cmd::BenchModelArgs),
    /// Print GRPO advantages for a batch of rewards (grouped contiguously).
    Advantages {
        /// Comma-separated rewards; `nan` marks an unscorable completion.
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
        rewards: Vec<String>,
        /// Completions per prompt (TRL's num_generations).
        #[arg(long)]
        num_generations: usize,
        /// group | batch | none (TRL's scale_rewards), or `rloo` for leave-one-out.
        #[arg(long, default_value = "group")]
        scale_rewards: String,
    },
    /// Offline demo: a tiny model learns arithmetic with GRPO in a few minutes.
    Demo(DemoArgs),
    /// The GRPO step benchmark of bench/README.md (the TRL comparison) on a model directory: one JSON line.
    Bench(BenchArgs),
    /// PNG curves (reward, reward_std, kl, loss, completion length, step time) of a run.
    Plot {
        /// The run directory (with metrics.jsonl).
        run_dir: std::path::PathBuf,
    },
    /// Train with GRPO from a config file (TOML or YAML); `algorithm = "sft" | "dpo" | "kto" | "bco" |
    /// "orpo" | "cpo" | "tpo" | "online_dpo" | "xpo" | "nash_md" | "a2po" | "rloo" | "reward" |
    /// "distillation" | "gkd" | "gold" | "iw_opd" | "sdpo" | "sdft" | "ssd"` in the config runs
    /// that instead.
    Train(train_cmd::TrainArgs),
    /// Supervised fine-tuning (the config's `[sft]`): the loss on completion tokens only.
    Sft(train_cmd::TrainArgs),
    /// Direct preference optimisation (the config's `[dpo]`) against the frozen reference.
    Dpo(train_cmd::TrainArgs),
    /// Kahneman-Tversky optimisation (the config's `[kto]`) on unpaired, labelled completions.
    Kto(train_cmd::TrainArgs),
    /// Binary classifier optimisation (TRL's BCOTrainer) on KTO's unpaired, labelled
    /// completions (the config's `[kto]` columns and β): each implicit reward a classifier's
    /// logit, shifted by their running mean.
    Bco(train_cmd::TrainArgs),
    /// Odds-ratio preference optimisation (the config's `[orpo]`, TRL's ORPOTrainer): no
    /// reference model; the chosen sequences' NLL plus an odds-ratio term.
    Orpo(train_cmd::TrainArgs),
    /// Contrastive preference optimisation (the config's `[cpo]`, TRL's CPOTrainer), with the
    /// SimPO and AlphaPO loss types: no reference model.
    Cpo(train_cmd::TrainArgs),
    /// Triple preference optimisation (the config's `[tpo]`, TRL's TPOTrainer): chosen,
    /// rejected and a gold completion, no reference model.
    Tpo(train_cmd::TrainArgs),
    /// Online DPO (the config's `[online_dpo]`, TRL's OnlineDPOTrainer): two samples per
    /// prompt, the rewards pick the chosen one, DPO's loss against the frozen reference.
    #[command(alias = "online_dpo")]
    OnlineDpo(train_cmd::TrainArgs),
    /// Exploratory preference optimisation (the config's `[online_dpo]` and `[xpo]`, TRL's
    /// XPOTrainer): online DPO on a policy sample against a reference sample, plus `alpha`
    /// times the policy's log-likelihood of the reference's.
    Xpo(train_cmd::TrainArgs),
    /// Nash mirror descent (the config's `[online_dpo]` and `[nash_md]`, TRL's NashMDTrainer):
    /// the policy's sample against one of the policy–reference geometric mixture; the
    /// preference probability weighs a REINFORCE step with a KL penalty.
    #[command(alias = "nash_md")]
    NashMd(train_cmd::TrainArgs),
    /// A*-PO (the config's `[a2po]`, TRL's A2POTrainer): optimal values estimated from the
    /// reference's samples, then one sample per prompt regressed onto its optimal advantage.
    A2po(train_cmd::TrainArgs),
    /// Self-distillation policy optimisation (the config's `[sdpo]`, TRL's SDPOTrainer): the
    /// policy learns toward itself shown a successful sibling completion or the row's feedback.
    Sdpo(train_cmd::TrainArgs),
    /// Self-distillation fine-tuning (the config's `[sdft]`, TRL's SDFTTrainer): the policy
    /// learns toward itself shown each row's privileged context; no rewards.
    Sdft(train_cmd::TrainArgs),
    /// Simple self-distillation (the config's `[ssd]`, TRL's SSDTrainer): the policy learns
    /// its own samples by cross-entropy; no rewards, verifier or teacher.
    Ssd(train_cmd::TrainArgs),
    /// MiniLLM (the config's `[minillm]`, the teacher from `[distillation]`, TRL's
    /// MiniLLMTrainer): GRPO's step with each token's advantage raised by the teacher's
    /// log-prob over the student's, plus the reverse KL to the teacher.
    Minillm(train_cmd::TrainArgs),
    /// A process reward model (the config's `[prm]`, TRL's PRMTrainer): a token classifier
    /// learns to label each step of a completion correct or not.
    Prm(train_cmd::TrainArgs),
    /// PPO (the config's `[ppo]`, TRL's PPOTrainer): the policy and a value model trained
    /// together, GAE advantages from the rewards' score and a KL penalty to the reference.
    Ppo(train_cmd::TrainArgs),
    /// REINFORCE leave-one-out (the config's `[rloo]`): GRPO's pipeline with RLOO's objective.
    Rloo(train_cmd::TrainArgs),
    /// Reward-model training (the config's `[reward]`, TRL's RewardTrainer): a sequence
    /// classifier learns to score each chosen sequence above its rejected one.
    Reward(train_cmd::TrainArgs),
    /// On-policy distillation (the config's `[distillation]`, TRL's DistillationTrainer): the
    /// policy samples completions and learns the teacher's next-token distributions on them.
    Distillation(train_cmd::TrainArgs),
    /// Generalized knowledge distillation (the config's `[distillation]` with TRL's GKDTrainer
    /// defaults): each step on the student's samples with probability `lmbda`, else on the
    /// dataset's completions (or the teacher's samples, `seq_kd`).
    Gkd(train_cmd::TrainArgs),
    /// General online logit distillation (TRL's GOLDTrainer): GKD's steps, and with
    /// `gold.use_uld_loss` a teacher with another tokenizer (universal logit distillation).
    Gold(train_cmd::TrainArgs),
    /// Importance-weighted on-policy distillation (the config's `[distillation]`, TRL's
    /// IWOPDTrainer): the student's sampled tokens, each weighed by the teacher's log-ratio and
    /// how early it comes in the completion.
    #[command(alias = "iw_opd")]
    IwOpd(train_cmd::TrainArgs),
    /// Self-test of this build on a device: fused ops vs compositions, device vs CPU, gradient
    /// checkpointing, training steps, generation; exit 1 on any failure.
    Check(grpo_cli::DeviceArgs),
    /// Play scripted assistant turns against a config's `[environment]`, without a model: the
    /// prompt after `reset`, the tools, each turn's observation and reward, the episode's rewards.
    Env(env_cmd::EnvArgs),
    /// Translate a TRL recipe (the YAML `trl grpo --config` reads) into a config of ours.
    ImportTrl(import_cmd::ImportTrlArgs),
    /// Translate a verl run (a script running `python3 -m verl.trainer.main_ppo key=value ...`,
    /// or a YAML of verl's config) into a config of ours.
    ImportVerl(import_cmd::ImportVerlArgs),
    /// Score a file of completions with a config's rewards, without training.
    Score(score_cmd::ScoreArgs),
    /// Datasets: inspect a file, make synthetic data, benchmark reading.
    Data {
        #[command(subcommand)]
        command: data_cmd::DataCommand,
    },
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Some(Command::Train(a)) => Ok(ExitCode::from(train_cmd::train(a)?)),
        Some(Command::Sft(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("sft"))?)),
        Some(Command::Dpo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("dpo"))?)),
        Some(Command::Kto(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("kto"))?)),
        Some(Command::Bco(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("bco"))?)),
        Some(Command::Orpo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("orpo"))?)),
        Some(Command::Cpo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("cpo"))?)),
        Some(Command::Tpo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("tpo"))?)),
        Some(Command::A2po(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("a2po"))?)),
        Some(Command::Sdpo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("sdpo"))?)),
        Some(Command::Sdft(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("sdft"))?)),
        Some(Command::Ssd(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("ssd"))?)),
        Some(Command::Minillm(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("minillm"))?)),
        Some(Command::Prm(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("prm"))?)),
        Some(Command::Ppo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("ppo"))?)),
        Some(Command::IwOpd(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("iw_opd"))?)),
        Some(Command::OnlineDpo(a)) => {
            Ok(ExitCode::from(train_cmd::train_as(a, Some("online_dpo"))?))
        }
        Some(Command::Xpo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("xpo"))?)),
        Some(Command::NashMd(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("nash_md"))?)),
        Some(Command::Rloo(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("rloo"))?)),
        Some(Command::Reward(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("reward"))?)),
        Some(Command::Distillation(a)) => Ok(ExitCode::from(train_cmd::train_as(
            a,
            Some("distillation"),
        )?)),
        Some(Command::Gkd(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("gkd"))?)),
        Some(Command::Gold(a)) => Ok(ExitCode::from(train_cmd::train_as(a, Some("gold"))?)),
        Some(Command::Check(a)) => {
            let (device, dtype) = a.resolve()?;
            let rows = grpo_cli::check::run_checks(&device, dtype)?;
            let ok = grpo_cli::check::print_table(&rows);
            for line in grpo_cli::check::device_notes(&device) {
                println!("{line}");
            }
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        other => dispatch(other).map(|()| ExitCode::SUCCESS),
    }
}

fn dispatch(command: Option<Command>) -> Result<()> {
    match command {
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            println!();
            Ok(())
        }
        Some(Command::Generate(a)) => model_cmd::generate(a),
        Some(Command::Env(a)) => env_cmd::env(a),
        Some(Command::ImportTrl(a)) => import_cmd::import_trl(a),
        Some(Command::ImportVerl(a)) => import_cmd::import_verl(a),
        Some(Command::Score(a)) => score_cmd::score(a),
        Some(Command::Logprobs(a)) => model_cmd::logprobs(a),
        Some(Command::ChatTemplate(a)) => model_cmd::chat_template(a),
        Some(Command::InitModel(a)) => model_cmd::init_model(a),
        Some(Command::Export(a)) => model_cmd::export(a),
        Some(Command::Merge(a)) => model_cmd::merge(a),
        Some(Command::Serve(a)) => model_cmd::serve(a),
        Some(Command::BenchModel(a)) => bench_cmd::bench_model(a),
        Some(Command::Advantages {
            rewards,
            num_generations,
            scale_rewards,
        }) => {
            let rewards = rewards
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    r.trim()
                        .parse::<f32>()
                        .with_context(|| format!("--rewards: value {i} `{r}` is not a number"))
                })
                .collect::<Result<Vec<f32>>>()?;
            if num_generations == 0 || rewards.len() % num_generations != 0 {
                bail!(
                    "--num-generations {num_generations} must be >= 1 and divide the number of rewards ({})",
                    rewards.len()
                );
            }
            let adv = if scale_rewards == "rloo" {
                leave_one_out_advantages(&rewards, num_generations)
            } else {
                let scale: ScaleRewards = scale_rewards
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!("--scale-rewards: {e}"))?;
                group_advantages(&rewards, num_generations, scale)
            };
            let text: Vec<String> = adv.iter().map(|a| format!("{a}")).collect();
            println!("{}", text.join(","));
            Ok(())
        }
        Some(Command::Data { command }) => data_cmd::run(command),
        Some(
            Command::Train(_)
            | Command::Sft(_)
            | Command::Dpo(_)
            | Command::Kto(_)
            | Command::Bco(_)
            | Command::Orpo(_)
            | Command::Cpo(_)
            | Command::Tpo(_)
            | Command::OnlineDpo(_)
            | Command::Xpo(_)
            | Command::NashMd(_)
            | Command::A2po(_)
            | Command::Sdpo(_)
            | Command::Sdft(_)
            | Command::Ssd(_)
            | Command::Minillm(_)
            | Command::Prm(_)
            | Command::Ppo(_)
            | Command::Rloo(_)
            | Command::Reward(_)
            | Command::Distillation(_)
            | Command::Gkd(_)
            | Command::Gold(_)
            | Command::IwOpd(_)
            | Command::Check(_),
        ) => {
            unreachable!("handled in run")
        }
        Some(Command::Demo(a)) => demo(a),
        Some(Command::Plot { run_dir }) => {
            println!("{}", grpo_cli::plot::plot_run(&run_dir)?.display());
            Ok(())
        }
        Some(Command::Bench(a)) => {
            let o = grpo_cli::bench::BenchOptions {
                steps: a.steps,
                completion: a.completion_length,
                lora_r: a.lora_r,
                prompts: a.prompts,
                generations: a.generations,
                micro_batch: a.micro_batch,
                gradient_checkpointing: a.gradient_checkpointing,
                max_staleness: a.max_staleness,
                optim: a.optim.clone(),
                device: a.place.device.clone(),
                dtype: a.place.dtype.clone(),
                ..Default::default()
            };
            let line = grpo_cli::bench::run(&a.model, &o)?;
            println!("{line}");
            Ok(())
        }
    }
}

/// `grpo-cli demo`.
#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// `arithmetic` (one-digit arithmetic with the accuracy reward) or `calculator` (a model
    /// calls a calculator tool: multi-turn episodes against the tool environment).
    #[arg(long, default_value = "arithmetic", value_parser = ["arithmetic", "calculator"])]
    task: String,
    /// Run directory (default runs/demo, or runs/calculator).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Supervised warm-up steps (default 400 / 800).
    #[arg(long)]
    sft_steps: Option<usize>,
    /// GRPO steps (default 120 / 60).
    #[arg(long)]
    steps: Option<usize>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// `grpo-cli bench`.
#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// A Hugging Face model directory (e.g. bench/make_tiny_model.py's tiny-qwen2).
    #[arg(long)]
    model: std::path::PathBuf,
    /// Steps (the first is excluded from the median).
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Completion tokens per sample (the shared workload: 64).
    #[arg(long, default_value_t = 64)]
    completion_length: usize,
    /// Train LoRA adapters of this rank (alpha = 2r, all seven projections) instead of every
    /// weight.
    #[arg(long)]
    lora_r: Option<usize>,
    /// Prompts per step.
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Generations per prompt.
    #[arg(long, default_value_t = 8)]
    generations: usize,
    /// Completions per micro-batch (`train.per_device_train_batch_size`; default the step).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// `train.gradient_checkpointing = true`.
    #[arg(long)]
    gradient_checkpointing: bool,
    /// `pipeline.max_staleness`: 1 or more overlaps the next step's generation with the
    /// learner's step (off-policy by up to that many versions).
    #[arg(long, default_value_t = 0)]
    max_staleness: usize,
    /// `optim.optim`: `adamw_torch` (default) or `adamw_8bit` (bitsandbytes' 8-bit AdamW).
    #[arg(long, default_value = "adamw_torch")]
    optim: String,
    #[command(flatten)]
    place: grpo_cli::DeviceArgs,
}

fn demo(a: DemoArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    if a.task == "calculator" {
        return calculator_demo(a);
    }
    let r = grpo_cli::demo::run(&grpo_cli::demo::DemoOptions {
        out: a.out.clone().unwrap_or_else(|| "runs/demo".into()),
        sft_steps: a.sft_steps.unwrap_or(400),
        grpo_steps: a.steps.unwrap_or(120),
        seed: a.seed,
        progress: true,
        device: a.device.clone(),
    })?;
    let run = &r.result.run_dir;
    println!(
        "warm-up loss {:.3} → {:.3}; GRPO accuracy reward {:.3} (first {n} steps) → {:.3} (last {n} steps) in {:.0} s",
        r.sft_loss.0,
        r.sft_loss.1,
        r.first_reward,
        r.last_reward,
        t0.elapsed().as_secs_f64(),
        n = grpo_cli::demo::REPORT_STEPS
    );
    println!("run directory: {}", run.display());
    println!("metrics: {}", run.join("metrics.jsonl").display());
    println!("completions: {}", run.join("completions.jsonl").display());
    println!("curves: {}", grpo_cli::plot::plot_run(run)?.display());
    Ok(())
}

fn calculator_demo(a: DemoArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let r = grpo_cli::calculator::run(&grpo_cli::demo::DemoOptions {
        out: a.out.unwrap_or_else(grpo_cli::calculator::default_out),
        sft_steps: a.sft_steps.unwrap_or(800),
        grpo_steps: a.steps.unwrap_or(60),
        seed: a.seed,
        progress: true,
        device: a.device,
    })?;
    let run = &r.result.run_dir;
    println!(
        "warm-up loss {:.3} → {:.3}; GRPO accuracy reward {:.3} → {:.3}, tool calls per episode {:.2} → {:.2} (first / last {n} steps) in {:.0} s",
        r.sft_loss.0,
        r.sft_loss.1,
        r.reward.0,
        r.reward.1,
        r.tool_calls.0,
        r.tool_calls.1,
        t0.elapsed().as_secs_f64(),
        n = grpo_cli::calculator::REPORT_STEPS
    );
    println!("run directory: {}", run.display());
    println!(
        "completions (transcripts): {}",
        run.join("completions.jsonl").display()
    );
    println!("curves: {}", grpo_cli::plot::plot_run(run)?.display());
    Ok(())
}

/// candle asks for its thread count on every matmul and, unless `RAYON_NUM_THREADS` is set,
/// re-reads `/proc/cpuinfo` each time (measured: ~2,400 reads per generation benchmark, 10-20%
/// of its time). Setting the variable once makes that a cheap lookup.
#[allow(unsafe_code)]
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: called first thing in `main`, before any other thread exists.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    }
}

/// Tensors of megabytes are allocated and freed by the thousand per step. By default glibc
/// serves them with fresh `mmap`s and returns them on free, so every step pays page faults and
/// kernel zeroing again; keeping blocks up to 32 MiB in the heap lets them be reused (measured:
/// forward + backward 10% faster on the tiny benchmark model).
#[allow(unsafe_code)]
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() -> ExitCode {
    pin_thread_count();
    tune_malloc();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", grpo_cli::error_line(&e));
            ExitCode::from(2)
        }
    }
}
