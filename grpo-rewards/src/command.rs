//! `type = "command"`: a program scores each completion (feature `command`).
//!
//! For every completion the reward starts the program of `argv` once (no shell) in a fresh
//! temporary directory, hands it the completion through `{completion}` in `argv`, on stdin
//! (`stdin = true`) and/or as a file in that directory (`file = "solution.py"`), and turns the
//! run into a score: exit status 0 → 1.0, else 0.0 (`score = "exit_status"`), or the last
//! non-empty line of stdout as a number (`score = "stdout"`). At most `max_concurrent` programs
//! of one reward run at once, each in its own process group (killed whole on a timeout), under
//! optional CPU and address-space limits. A program that runs past `timeout`, floods stdout
//! past `max_output_bytes`, dies by a signal (as the CPU limit kills) or prints no number
//! scores `on_failure` (by default `None`: no opinion) and is counted in
//! `rewards/{name}/timeouts` or `rewards/{name}/failures`; past the memory limit allocations
//! fail, and the program exits as it handles that.
//!
//! ```
//! use grpo_rewards::command::{CommandConfig, CommandReward, CommandScore};
//! use grpo_rewards::{Reward, RewardInput};
//!
//! // The completion on stdin, the score the number `wc -c` prints.
//! let reward = CommandReward::new(
//!     CommandConfig {
//!         argv: vec!["wc".into(), "-c".into()],
//!         stdin: true,
//!         score: CommandScore::Stdout,
//!         ..CommandConfig::default()
//!     },
//!     "length",
//! )
//! .unwrap();
//! let out = reward.score(&[RewardInput::new("Say hi", "hi")]).unwrap();
//! assert_eq!(out.scores, vec![Some(2.0)]);
//! assert_eq!(out.counters["rewards/length/failures"], 0.0);
//! ```

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, RewardError};
use crate::reward::Reward;
use crate::types::{RewardInput, RewardOutput};

/// How a run becomes a score (`score = "exit_status"` or `"stdout"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommandScore {
    /// Exit status 0 → 1.0, any other exit status → 0.0.
    #[default]
    ExitStatus,
    /// The last non-empty line of stdout, parsed as a finite number. A non-zero exit status or
    /// a line that is not a number is a failure.
    Stdout,
}

/// Config of [`CommandReward`] (`type = "command"`).
///
/// ```toml
/// [[rewards]]
/// type = "command"
/// name = "tests"
/// argv = ["scripts/run_python_tests.py", "{tests}"]
/// stdin = true
/// score = "stdout"
/// timeout = 10
/// max_memory_mb = 1024
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CommandConfig {
    /// The program and its arguments, run without a shell. `argv[0]` is looked up on `PATH`
    /// when it holds no `/`, else taken as a path (relative to the current directory when the
    /// reward is built); it must exist then. The arguments may hold the placeholders
    /// `{completion}`, `{prompt}` and `{column}` for any column of the sample (a sample without
    /// that column is an error); `{{name}}` is a literal `{name}`, and other braces are kept as
    /// they are.
    pub argv: Vec<String>,
    /// Write the completion to the program's stdin (then close it). Default `false`: stdin is
    /// empty.
    pub stdin: bool,
    /// Write the completion to a file of this (relative) name in the program's working
    /// directory, a fresh temporary directory per sample.
    pub file: Option<String>,
    /// How a run becomes a score. Default `exit_status`.
    pub score: CommandScore,
    /// Seconds a run may take before its process group is killed. Default 10.
    #[serde(alias = "timeout_secs")]
    pub timeout: f64,
    /// Programs of this reward running at once (over all batches). Default 4.
    pub max_concurrent: usize,
    /// CPU seconds a run may use (`RLIMIT_CPU`, unix only); past it the program is killed.
    pub max_cpu_seconds: Option<u64>,
    /// Address space a run may use, in MiB (`RLIMIT_AS`, unix only); allocations past it fail.
    pub max_memory_mb: Option<u64>,
    /// Bytes of stdout read from a run; a program writing more is killed and counted as a
    /// failure. Default 1 MiB.
    pub max_output_bytes: usize,
    /// Extra environment variables of the program (added to the inherited environment).
    pub env: BTreeMap<String, String>,
    /// The score of a run that timed out, crashed or printed no number. Default absent:
    /// `None` (no opinion; the completion is left out of this reward's sum).
    pub on_failure: Option<f32>,
}

impl Default for CommandConfig {
    fn default() -> Self {
        Self {
            argv: Vec::new(),
            stdin: false,
            file: None,
            score: CommandScore::ExitStatus,
            timeout: 10.0,
            max_concurrent: 4,
            max_cpu_seconds: None,
            max_memory_mb: None,
            max_output_bytes: 1 << 20,
            env: BTreeMap::new(),
            on_failure: None,
        }
    }
}

impl CommandConfig {
    /// The dataset columns that `argv`'s placeholders name (`{tests}` → `tests`), in order,
    /// without repeats: the trainer checks the data has them before it starts.
    pub fn columns(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for arg in self.argv.iter().skip(1) {
            for p in parse_arg(arg) {
                if let Piece::Column(c) = p
                    && !out.contains(&c)
                {
                    out.push(c);
                }
            }
        }
        out
    }

    /// Checks the values (not the program, see [`CommandReward::new`]); the error names the
    /// field.
    pub fn validate(&self) -> Result<()> {
        let Some(program) = self.argv.first() else {
            return Err(RewardError::config(
                "argv",
                "must name a program, e.g. [\"python3\", \"check.py\", \"{completion}\"]",
            ));
        };
        if program.trim().is_empty() {
            return Err(RewardError::config(
                "argv",
                "argv[0] (the program) is empty",
            ));
        }
        if parse_arg(program)
            .iter()
            .any(|p| !matches!(p, Piece::Text(_)))
        {
            return Err(RewardError::config(
                "argv",
                format!("argv[0] (the program) cannot hold a placeholder: `{program}`"),
            ));
        }
        let in_argv = self.argv[1..]
            .iter()
            .any(|a| parse_arg(a).contains(&Piece::Completion));
        if !in_argv && !self.stdin && self.file.is_none() {
            return Err(RewardError::config(
                "argv",
                "the program never sees the completion: put `{completion}` in argv, or set \
                 `stdin = true` or `file`",
            ));
        }
        if let Some(file) = &self.file {
            let p = Path::new(file);
            let plain = !file.trim().is_empty()
                && p.components().all(|c| matches!(c, Component::Normal(_)));
            if !plain {
                return Err(RewardError::config(
                    "file",
                    format!(
                        "must be a relative file name without `..`, e.g. \"solution.py\"; got `{file}`"
                    ),
                ));
            }
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout <= 86_400.0) {
            return Err(RewardError::config(
                "timeout",
                format!("must be seconds in (0, 86400], got {}", self.timeout),
            ));
        }
        if self.max_concurrent == 0 {
            return Err(RewardError::config("max_concurrent", "must be ≥ 1"));
        }
        if self.max_output_bytes == 0 {
            return Err(RewardError::config("max_output_bytes", "must be ≥ 1"));
        }
        for (field, v) in [
            ("max_cpu_seconds", self.max_cpu_seconds),
            ("max_memory_mb", self.max_memory_mb),
        ] {
            match v {
                Some(0) => return Err(RewardError::config(field, "must be ≥ 1")),
                Some(_) if !cfg!(unix) => {
                    return Err(RewardError::config(
                        field,
                        "resource limits are only available on unix systems",
                    ));
                }
                _ => {}
            }
        }
        if self.max_memory_mb.is_some_and(|mb| mb > (1 << 40)) {
            return Err(RewardError::config("max_memory_mb", "is too large"));
        }
        for key in self.env.keys() {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(RewardError::config(
                    format!("env.{key}"),
                    "a variable name must be non-empty, without `=` or NUL",
                ));
            }
        }
        if self.env.values().any(|v| v.contains('\0')) {
            return Err(RewardError::config("env", "values cannot hold NUL"));
        }
        if let Some(f) = self.on_failure
            && !f.is_finite()
        {
            return Err(RewardError::config("on_failure", "must be a finite number"));
        }
        Ok(())
    }
}

/// One part of an argument: literal text or a placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Completion,
    Prompt,
    Column(String),
}

static PLACEHOLDER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\{\{([A-Za-z_][A-Za-z0-9_.-]*)\}\}|\{([A-Za-z_][A-Za-z0-9_.-]*)\}")
        .expect("the placeholder regex is valid")
});

/// Splits an argument into text and placeholders (`{{name}}` is the literal `{name}`).
fn parse_arg(arg: &str) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut last = 0;
    for c in PLACEHOLDER.captures_iter(arg) {
        let Some(whole) = c.get(0) else { continue };
        text.push_str(&arg[last..whole.start()]);
        last = whole.end();
        if let Some(escaped) = c.get(1) {
            text.push('{');
            text.push_str(escaped.as_str());
            text.push('}');
            continue;
        }
        let Some(name) = c.get(2) else { continue };
        if !text.is_empty() {
            pieces.push(Piece::Text(std::mem::take(&mut text)));
        }
        pieces.push(match name.as_str() {
            "completion" => Piece::Completion,
            "prompt" => Piece::Prompt,
            other => Piece::Column(other.to_owned()),
        });
    }
    text.push_str(&arg[last..]);
    if !text.is_empty() || pieces.is_empty() {
        pieces.push(Piece::Text(text));
    }
    pieces
}

/// Counts the programs of one reward that run at once.
#[derive(Debug)]
struct Permits {
    free: Mutex<usize>,
    freed: Condvar,
}

struct Permit<'a>(&'a Permits);

impl Permits {
    fn acquire(&self) -> Permit<'_> {
        let mut free = lock(&self.free);
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|e| e.into_inner());
        }
        *free -= 1;
        Permit(self)
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *lock(&self.0.free) += 1;
        self.0.freed.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Scores each completion with a program: see the [module docs](self).
#[derive(Debug)]
pub struct CommandReward {
    name: String,
    config: CommandConfig,
    program: PathBuf,
    args: Vec<Vec<Piece>>,
    permits: Permits,
}

impl CommandReward {
    /// Validates `config`, resolves the program (on `PATH`, or a path that exists) and names
    /// the reward `name` (in errors and in the counters `rewards/{name}/timeouts` and
    /// `rewards/{name}/failures`).
    pub fn new(config: CommandConfig, name: impl Into<String>) -> Result<Self> {
        config.validate()?;
        let path_var = config
            .env
            .get("PATH")
            .map(OsStr::new)
            .map(ToOwned::to_owned)
            .or_else(|| std::env::var_os("PATH"));
        let program = resolve_program(&config.argv[0], path_var.as_deref())
            .map_err(|m| RewardError::config("argv", m))?;
        let args = config.argv[1..].iter().map(|a| parse_arg(a)).collect();
        Ok(Self {
            name: name.into(),
            program,
            args,
            permits: Permits {
                free: Mutex::new(config.max_concurrent),
                freed: Condvar::new(),
            },
            config,
        })
    }

    /// The program as resolved at build (an absolute path).
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The arguments for sample `index`, placeholders filled in.
    fn render(&self, index: usize, x: &RewardInput) -> Result<Vec<String>> {
        let mut args = Vec::with_capacity(self.args.len());
        for pieces in &self.args {
            let mut arg = String::new();
            for p in pieces {
                match p {
                    Piece::Text(t) => arg.push_str(t),
                    Piece::Completion => arg.push_str(&x.completion),
                    Piece::Prompt => arg.push_str(&x.prompt),
                    Piece::Column(c) => match x.field(c).and_then(|v| v.as_text()) {
                        Some(v) => arg.push_str(&v),
                        None => {
                            let have: Vec<&str> = x.fields.keys().map(String::as_str).collect();
                            return Err(RewardError::Sample {
                                reward: self.name.clone(),
                                index,
                                message: format!(
                                    "argv placeholder `{{{c}}}`: the sample has no column `{c}`, or it \
                                     is null (placeholders are {{completion}}, {{prompt}} or a column; \
                                     its columns: {})",
                                    if have.is_empty() {
                                        "none".to_owned()
                                    } else {
                                        have.join(", ")
                                    }
                                ),
                            });
                        }
                    },
                }
            }
            args.push(arg);
        }
        Ok(args)
    }

    fn sample_error(&self, index: usize, message: String) -> RewardError {
        RewardError::Sample {
            reward: self.name.clone(),
            index,
            message,
        }
    }

    /// Runs the program once for sample `index`.
    fn run(&self, index: usize, x: &RewardInput, args: &[String]) -> Result<Run> {
        let dir = tempfile::Builder::new()
            .prefix("grpo-command-")
            .tempdir()
            .map_err(|e| self.sample_error(index, format!("temporary directory: {e}")))?;
        if let Some(file) = &self.config.file {
            let path = dir.path().join(file);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| {
                    self.sample_error(index, format!("cannot create {}: {e}", parent.display()))
                })?;
            }
            std::fs::write(&path, &x.completion).map_err(|e| {
                self.sample_error(
                    index,
                    format!("cannot write {} (file): {e}", path.display()),
                )
            })?;
        }
        let mut cmd = Command::new(&self.program);
        cmd.args(args)
            .current_dir(dir.path())
            .envs(&self.config.env)
            .stdin(if self.config.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        sys::configure(
            &mut cmd,
            Limits {
                cpu_seconds: self.config.max_cpu_seconds,
                memory_bytes: self.config.max_memory_mb.map(|mb| mb << 20),
            },
        );
        let start = Instant::now();
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound) => {
                return Err(self.sample_error(
                    index,
                    format!("cannot start `{}`: {e}", self.program.display()),
                ));
            }
            // An argument with a NUL byte, too long an argument list, no process left...:
            // this sample fails, the others go on.
            Err(e) => return Ok(Run::not_started(e.to_string())),
        };
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let proc = Arc::new(Proc::new(child));
        match self.watch(&proc, start, x, stdin, stdout, stderr) {
            Ok(run) => Ok(run),
            Err(e) => {
                proc.kill();
                let _ = proc.reap();
                Err(self.sample_error(index, format!("cannot start a thread: {e}")))
            }
        }
        // `dir` is removed here.
    }

    /// Feeds, reads, times and reaps a started program.
    fn watch(
        &self,
        proc: &Arc<Proc>,
        start: Instant,
        x: &RewardInput,
        stdin: Option<std::process::ChildStdin>,
        stdout: Option<std::process::ChildStdout>,
        stderr: Option<std::process::ChildStderr>,
    ) -> io::Result<Run> {
        let timeout = Duration::from_secs_f64(self.config.timeout);
        let (cancel, cancelled) = mpsc::channel::<()>();
        let timer = {
            let proc = proc.clone();
            std::thread::Builder::new()
                .name("grpo-command-timer".into())
                .spawn(move || match cancelled.recv_timeout(timeout) {
                    Err(RecvTimeoutError::Timeout) => {
                        proc.kill();
                        true
                    }
                    _ => false,
                })?
        };
        let (out_tx, out_rx) = mpsc::channel();
        if let Some(stdout) = stdout {
            let proc = proc.clone();
            let cap = self.config.max_output_bytes;
            let keep = self.config.score == CommandScore::Stdout;
            std::thread::Builder::new()
                .name("grpo-command-stdout".into())
                .spawn(move || {
                    let (bytes, flooded) = read_capped(stdout, cap, keep);
                    if flooded {
                        proc.kill();
                    }
                    let _ = out_tx.send((bytes, flooded));
                })?;
        }
        let (err_tx, err_rx) = mpsc::channel();
        if let Some(stderr) = stderr {
            std::thread::Builder::new()
                .name("grpo-command-stderr".into())
                .spawn(move || {
                    let _ = err_tx.send(read_tail(stderr, STDERR_TAIL));
                })?;
        }
        if let Some(mut stdin) = stdin {
            let bytes = x.completion.clone().into_bytes();
            // Detached: a program that never reads its stdin must not hold the run up.
            std::thread::Builder::new()
                .name("grpo-command-stdin".into())
                .spawn(move || {
                    let _ = stdin.write_all(&bytes);
                })?;
        }
        proc.wait_exit();
        let seconds = start.elapsed().as_secs_f64();
        drop(cancel);
        let timed_out = timer.join().unwrap_or(false);
        // Whatever the program left behind in its process group goes with it.
        proc.kill();
        let grace = Instant::now() + OUTPUT_GRACE;
        let output = out_rx.recv_timeout(grace.saturating_duration_since(Instant::now()));
        let stderr = err_rx
            .recv_timeout(grace.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        let status = proc.reap();
        let ending = match (&output, status) {
            _ if timed_out => Ending::Timeout,
            (Ok((_, true)), _) => Ending::OutputLimit,
            (Err(_), _) => Ending::OutputHeld,
            (_, Err(e)) => Ending::NotStarted(format!("lost the program's exit status: {e}")),
            (Ok(_), Ok(status)) => sys::ending(status),
        };
        Ok(Run {
            ending,
            stdout: output.map(|(b, _)| b).unwrap_or_default(),
            stderr,
            seconds,
        })
    }

    /// Runs the program once for `input` (placeholders, stdin and file as for a score) and
    /// returns what it printed, for callers that use its output rather than a score (a tool).
    /// Errors are those of a score: a placeholder's missing column, a program that cannot
    /// start.
    pub fn output(&self, input: &RewardInput) -> Result<CommandOutput> {
        let args = self.render(0, input)?;
        let run = {
            let _permit = self.permits.acquire();
            self.run(0, input, &args)?
        };
        let (status, exit_code) = match &run.ending {
            Ending::Exited(0) => ("ok", Some(0)),
            Ending::Exited(c) => ("exit_code", Some(*c)),
            Ending::Signal(_) => ("signal", None),
            Ending::Timeout => ("timeout", None),
            Ending::OutputLimit => ("output_limit", None),
            Ending::OutputHeld => ("output_held", None),
            Ending::NotStarted(_) => ("not_started", None),
        };
        let stderr = match run.ending {
            Ending::NotStarted(e) => e,
            _ => run.stderr,
        };
        Ok(CommandOutput {
            status,
            exit_code,
            stdout: String::from_utf8_lossy(&run.stdout).into_owned(),
            stderr,
            seconds: run.seconds,
        })
    }

    /// The score, status and info of a run; whether it timed out or failed.
    fn judge(&self, run: Run) -> Judged {
        let mut info = serde_json::Map::new();
        let mut exit_code = None;
        let status = match run.ending {
            Ending::Timeout => Status::Timeout,
            Ending::OutputLimit => Status::Failure("output_limit"),
            Ending::OutputHeld => Status::Failure("output_held"),
            Ending::NotStarted(e) => {
                info.insert("error".into(), e.into());
                Status::Failure("not_started")
            }
            Ending::Signal(s) => {
                info.insert("signal".into(), s.into());
                Status::Failure("signal")
            }
            Ending::Exited(code) => {
                exit_code = Some(code);
                match self.config.score {
                    CommandScore::ExitStatus => Status::Score(if code == 0 { 1.0 } else { 0.0 }),
                    CommandScore::Stdout if code != 0 => Status::Failure("exit_code"),
                    CommandScore::Stdout => match last_number(&run.stdout) {
                        Some(v) => Status::Score(v),
                        None => Status::Failure("unparseable"),
                    },
                }
            }
        };
        let (score, label) = match status {
            Status::Score(v) => (Some(v), "ok"),
            Status::Timeout => (self.config.on_failure, "timeout"),
            Status::Failure(what) => (self.config.on_failure, what),
        };
        info.insert("status".into(), label.into());
        if let Some(code) = exit_code {
            info.insert("exit_code".into(), code.into());
        }
        info.insert("seconds".into(), run.seconds.into());
        if !run.stderr.is_empty() {
            info.insert("stderr".into(), run.stderr.into());
        }
        Judged {
            score,
            info: serde_json::Value::Object(info),
            timeout: matches!(status, Status::Timeout),
            failure: matches!(status, Status::Failure(_)),
        }
    }
}

/// What one run printed ([`CommandReward::output`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CommandOutput {
    /// `ok` (exit status 0), `exit_code` (another), `signal`, `timeout`, `output_limit`,
    /// `output_held` or `not_started`.
    pub status: &'static str,
    /// The exit status, when it exited.
    pub exit_code: Option<i32>,
    /// Its stdout (at most `max_output_bytes`; invalid UTF-8 replaced). Kept only with
    /// `score = "stdout"` (else empty).
    pub stdout: String,
    /// The end of its stderr (or why it did not start).
    pub stderr: String,
    /// Seconds it ran.
    pub seconds: f64,
}

/// Stderr kept per run (its end), for the info.
const STDERR_TAIL: usize = 1024;
/// How long the output of a run that ended may stay open (held by a process that left the
/// program's process group).
const OUTPUT_GRACE: Duration = Duration::from_secs(1);

#[derive(Debug)]
enum Ending {
    Exited(i32),
    #[cfg_attr(not(unix), allow(dead_code))]
    Signal(i32),
    Timeout,
    OutputLimit,
    OutputHeld,
    NotStarted(String),
}

#[derive(Debug)]
struct Run {
    ending: Ending,
    stdout: Vec<u8>,
    stderr: String,
    seconds: f64,
}

impl Run {
    fn not_started(error: String) -> Self {
        Self {
            ending: Ending::NotStarted(error),
            stdout: Vec::new(),
            stderr: String::new(),
            seconds: 0.0,
        }
    }
}

enum Status {
    Score(f32),
    Timeout,
    Failure(&'static str),
}

struct Judged {
    score: Option<f32>,
    info: serde_json::Value,
    timeout: bool,
    failure: bool,
}

impl Reward for CommandReward {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        // Every argv first: a sample without a placeholder's column fails before any run.
        let argvs = batch
            .iter()
            .enumerate()
            .map(|(i, x)| self.render(i, x))
            .collect::<Result<Vec<_>>>()?;
        let n = batch.len();
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let workers = self.config.max_concurrent.min(n);
        let mut runs: Vec<Option<Result<Run>>> = (0..n).map(|_| None).collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    s.spawn(|| {
                        let mut done = Vec::new();
                        while !stop.load(Ordering::Relaxed) {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= n {
                                break;
                            }
                            let run = {
                                let _permit = self.permits.acquire();
                                self.run(i, &batch[i], &argvs[i])
                            };
                            if run.is_err() {
                                stop.store(true, Ordering::Relaxed);
                            }
                            done.push((i, run));
                        }
                        done
                    })
                })
                .collect();
            for h in handles {
                match h.join() {
                    Ok(done) => {
                        for (i, run) in done {
                            runs[i] = Some(run);
                        }
                    }
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
        });
        let mut out = RewardOutput {
            scores: Vec::with_capacity(n),
            info: Vec::with_capacity(n),
            counters: BTreeMap::new(),
        };
        let (mut timeouts, mut failures) = (0usize, 0usize);
        let mut judged = Vec::with_capacity(n);
        for run in runs.into_iter().flatten() {
            judged.push(run?);
        }
        for run in judged {
            let j = self.judge(run);
            timeouts += usize::from(j.timeout);
            failures += usize::from(j.failure);
            out.scores.push(j.score);
            out.info.push(Some(j.info));
        }
        out.counters
            .insert(format!("rewards/{}/timeouts", self.name), timeouts as f64);
        out.counters
            .insert(format!("rewards/{}/failures", self.name), failures as f64);
        Ok(out)
    }
}

/// Reads `r` to its end, keeping (when `keep`) at most `cap` bytes; `true` when it held more.
fn read_capped(mut r: impl Read, cap: usize, keep: bool) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut seen = 0usize;
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match r.read(&mut chunk) {
            Ok(0) => return (kept, false),
            Ok(k) => {
                let room = cap - seen;
                seen += k;
                if k > room {
                    if keep {
                        kept.extend_from_slice(&chunk[..room]);
                    }
                    return (kept, true);
                }
                if keep {
                    kept.extend_from_slice(&chunk[..k]);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return (kept, false),
        }
    }
}

/// Reads `r` to its end and returns its last `tail` bytes (lossy UTF-8).
fn read_tail(mut r: impl Read, tail: usize) -> String {
    let mut kept = Vec::new();
    let mut chunk = [0u8; 8 * 1024];
    loop {
        match r.read(&mut chunk) {
            Ok(0) => break,
            Ok(k) => {
                kept.extend_from_slice(&chunk[..k]);
                if kept.len() > 2 * tail {
                    kept.drain(..kept.len() - tail);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let from = kept.len().saturating_sub(tail);
    String::from_utf8_lossy(&kept[from..]).trim_end().to_owned()
}

/// The last non-empty line of `stdout` as a finite number.
fn last_number(stdout: &[u8]) -> Option<f32> {
    let text = String::from_utf8_lossy(stdout);
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?;
    line.trim().parse::<f32>().ok().filter(|v| v.is_finite())
}

/// `program` as an absolute path: found on `path_var` when it is a bare name, else a path
/// (relative to the current directory) that must exist.
fn resolve_program(
    program: &str,
    path_var: Option<&OsStr>,
) -> std::result::Result<PathBuf, String> {
    let p = Path::new(program);
    if p.components().count() > 1 || p.is_absolute() {
        let abs = if p.is_absolute() {
            p.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(|e| format!("cannot read the current directory: {e}"))?
                .join(p)
        };
        return if is_executable(&abs) {
            Ok(abs)
        } else if abs.exists() {
            Err(format!(
                "`{program}` ({}) is not an executable file",
                abs.display()
            ))
        } else {
            Err(format!(
                "the program `{program}` does not exist ({}; a relative path is taken from the \
                 current directory)",
                abs.display()
            ))
        };
    }
    let candidates: &[&str] = if cfg!(windows) { &["", ".exe"] } else { &[""] };
    if let Some(path_var) = path_var {
        for dir in std::env::split_paths(path_var) {
            for ext in candidates {
                let full = dir.join(format!("{program}{ext}"));
                if is_executable(&full) {
                    return Ok(if full.is_absolute() {
                        full
                    } else {
                        std::env::current_dir()
                            .map(|d| d.join(&full))
                            .unwrap_or(full)
                    });
                }
            }
        }
    }
    Err(format!("the program `{program}` was not found on PATH"))
}

fn is_executable(p: &Path) -> bool {
    let Ok(meta) = std::fs::metadata(p) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        meta.is_file() && meta.permissions().mode() & 0o111 != 0
    }
    #[cfg(not(unix))]
    {
        meta.is_file()
    }
}

/// Resource limits set in the child before exec (unix).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(unix), allow(dead_code))]
struct Limits {
    cpu_seconds: Option<u64>,
    memory_bytes: Option<u64>,
}

/// A started program. Its process group can be killed until the program is reaped (then the
/// group id might name someone else's processes, so `kill` does nothing any more).
#[derive(Debug)]
struct Proc {
    child: Mutex<Option<Child>>,
    pid: u32,
}

impl Proc {
    fn new(child: Child) -> Self {
        Self {
            pid: child.id(),
            child: Mutex::new(Some(child)),
        }
    }

    /// Kills the program and (on unix) everything in its process group.
    fn kill(&self) {
        let mut child = lock(&self.child);
        if let Some(c) = child.as_mut() {
            sys::kill(self.pid, c);
        }
    }

    /// Returns once the program has ended, without reaping it.
    fn wait_exit(&self) {
        sys::wait_exit(self);
    }

    /// Reaps the program: its exit status.
    fn reap(&self) -> io::Result<ExitStatus> {
        let child = lock(&self.child).take();
        match child {
            Some(mut c) => c.wait(),
            None => Err(io::Error::other("already reaped")),
        }
    }
}

#[cfg(unix)]
#[allow(unsafe_code)]
mod sys {
    //! Process groups, rlimits and waiting without reaping, through libc.

    use std::io;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Child, Command, ExitStatus};

    use super::{Ending, Limits, Proc};

    /// Own process group (so that a kill reaches grandchildren); the limits, if any, set in
    /// the child before exec. Without limits std can start the program with `posix_spawn`.
    pub(super) fn configure(cmd: &mut Command, limits: Limits) {
        cmd.process_group(0);
        if limits.cpu_seconds.is_none() && limits.memory_bytes.is_none() {
            return;
        }
        // SAFETY: the closure runs in the child between fork and exec. It only calls getrlimit
        // and setrlimit (async-signal-safe) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || apply(limits));
        }
    }

    macro_rules! set_limit {
        ($resource:expr, $soft:expr, $hard:expr) => {{
            let mut cur = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes into the valid `cur`.
            if unsafe { libc::getrlimit($resource, &mut cur) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let hard = ($hard as libc::rlim_t).min(cur.rlim_max);
            let new = libc::rlimit {
                rlim_cur: ($soft as libc::rlim_t).min(hard),
                rlim_max: hard,
            };
            // SAFETY: setrlimit reads the valid `new`.
            if unsafe { libc::setrlimit($resource, &new) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }};
    }

    fn apply(limits: Limits) -> io::Result<()> {
        // A program killed by a limit leaves no core file.
        set_limit!(libc::RLIMIT_CORE, 0, 0);
        if let Some(s) = limits.cpu_seconds {
            // SIGXCPU at the soft limit; SIGKILL a second later if the program ignores it.
            set_limit!(libc::RLIMIT_CPU, s, s.saturating_add(1));
        }
        if let Some(b) = limits.memory_bytes {
            set_limit!(libc::RLIMIT_AS, b, b);
        }
        Ok(())
    }

    /// SIGKILL to the program's process group (its id is the program's pid).
    pub(super) fn kill(pid: u32, _child: &mut Child) {
        if let Ok(pid) = libc::pid_t::try_from(pid) {
            // SAFETY: kill takes plain integers. The group exists while its leader is not
            // reaped, and `Proc` never calls this after reaping.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
    }

    /// Waits until the program ends, leaving it a zombie (`WNOWAIT`) so that its process
    /// group id stays its own until `Proc::reap`.
    pub(super) fn wait_exit(proc: &Proc) {
        let id = libc::id_t::from(proc.pid);
        loop {
            // SAFETY: siginfo_t is plain data, all zeros is a valid value.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid writes into the valid `info`.
            let r =
                unsafe { libc::waitid(libc::P_PID, id, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if r == 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return;
            }
        }
    }

    pub(super) fn ending(status: ExitStatus) -> Ending {
        match (status.code(), status.signal()) {
            (Some(code), _) => Ending::Exited(code),
            (None, Some(signal)) => Ending::Signal(signal),
            (None, None) => Ending::Exited(-1),
        }
    }
}

#[cfg(not(unix))]
mod sys {
    //! Elsewhere: no process groups or limits; the program alone is killed.

    use std::process::{Child, Command, ExitStatus};
    use std::time::Duration;

    use super::{Ending, Limits, Proc, lock};

    pub(super) fn configure(_cmd: &mut Command, _limits: Limits) {}

    pub(super) fn kill(_pid: u32, child: &mut Child) {
        let _ = child.kill();
    }

    pub(super) fn wait_exit(proc: &Proc) {
        loop {
            if let Some(c) = lock(&proc.child).as_mut() {
                if !matches!(c.try_wait(), Ok(None)) {
                    return;
                }
            } else {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub(super) fn ending(status: ExitStatus) -> Ending {
        Ending::Exited(status.code().unwrap_or(-1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_parse() {
        assert_eq!(
            parse_arg("--code={completion}"),
            vec![Piece::Text("--code=".into()), Piece::Completion]
        );
        assert_eq!(
            parse_arg("{prompt}{tests}"),
            vec![Piece::Prompt, Piece::Column("tests".into())]
        );
        assert_eq!(
            parse_arg("d = {'a': {1}}; f'{{x}}'"),
            vec![Piece::Text("d = {'a': {1}}; f'{x}'".into())]
        );
        assert_eq!(parse_arg(""), vec![Piece::Text(String::new())]);
        let c = CommandConfig {
            argv: vec![
                "{nope}".into(),
                "{tests}".into(),
                "{completion}{answer}{tests}{{skip}}".into(),
            ],
            ..CommandConfig::default()
        };
        assert_eq!(c.columns(), vec!["tests".to_owned(), "answer".to_owned()]);
    }

    #[test]
    fn capped_reads_keep_at_most_the_cap() {
        let data = vec![b'y'; 100_000];
        let (kept, flooded) = read_capped(&data[..], 1000, true);
        assert!(flooded);
        assert_eq!(kept.len(), 1000);
        let (kept, flooded) = read_capped(&data[..], 100_000, true);
        assert!(!flooded);
        assert_eq!(kept.len(), 100_000);
        let (kept, flooded) = read_capped(&data[..], 10, false);
        assert!(flooded && kept.is_empty());
        let tail = read_tail(&b"a\nb\nlast words\n"[..], 11);
        assert_eq!(tail, "last words");
    }

    #[test]
    fn the_last_non_empty_line_is_the_score() {
        assert_eq!(last_number(b"noise\n0.25\n\n"), Some(0.25));
        assert_eq!(last_number(b"  1 \r\n"), Some(1.0));
        assert_eq!(last_number(b"0.5\nnot a number\n"), None);
        assert_eq!(last_number(b"nan\n"), None);
        assert_eq!(last_number(b""), None);
    }
}
