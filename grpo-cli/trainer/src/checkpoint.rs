//! Checkpoints: `checkpoints/step-N` holds the policy (a Hugging Face directory, or the PEFT
//! adapter), the optimizer state, the synced reference (TR-DPO, BEMA's), SDPO's EMA teacher,
//! the BEMA state, `trainer_state.json` and the
//! config, so a run resumes exactly. The learner takes a [`CheckpointJob`] (the step's tensors,
//! which training no longer writes) and the events thread's [`CheckpointWriter`] writes it into
//! a temporary directory renamed into place, then prunes beyond `train.save_total_limit`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use grpo_rollout::{LoraConfig, Tokenizer, Transformer};

use crate::events::{Event, EventSink};
use crate::learner::{Learner, TrainerState};

/// The learner state file of a checkpoint.
pub const STATE_FILE: &str = "trainer_state.json";
const OPT_FILE: &str = "optimizer.safetensors";
const REF_FILE: &str = "reference.safetensors";

/// Everything one checkpoint holds, taken from the learner between two steps.
#[derive(Debug)]
pub struct CheckpointJob {
    /// `RUN_DIR/checkpoints/step-N`.
    pub dir: PathBuf,
    /// The policy: its trainable weights copied, the frozen ones shared.
    pub model: Transformer,
    /// Its adapter config (LoRA runs save the adapter only).
    pub lora: Option<LoraConfig>,
    /// The base model's path (the adapter's `base_model_name_or_path`).
    pub base_model: String,
    /// The tokenizer (full fine-tuning saves a whole model directory).
    pub tokenizer: Tokenizer,
    /// AdamW's moments, masters and step.
    pub optimizer: HashMap<String, Tensor>,
    /// The synced reference's weights (`reference.sync_ref_model`).
    pub reference: Option<HashMap<String, Tensor>>,
    /// SDPO's EMA teacher: its weights, or with LoRA its adapter tensors.
    pub teacher: Option<HashMap<String, Tensor>>,
    /// `[bema]`'s state.
    pub bema: Option<HashMap<String, Tensor>>,
    /// PPO's value model (its weights copied) and its AdamW state.
    pub value: Option<(Transformer, HashMap<String, Tensor>)>,
    /// `loss.replay_buffer_size`'s buffer (`replay_buffer.json`).
    pub replay: Option<crate::stages::replay::ReplayBuffer>,
    /// `trainer_state.json`.
    pub state: TrainerState,
    /// `config.json` (secrets removed).
    pub config: serde_json::Value,
    /// Checkpoints kept at most (0 = all).
    pub save_total_limit: usize,
    /// `[merge]` at this checkpoint: the policy merged with the target into `merged/`.
    pub merge: Option<(crate::config::MergeSection, PathBuf)>,
}

impl CheckpointJob {
    /// Writes the checkpoint atomically (a temporary directory renamed) and prunes the oldest
    /// beyond `save_total_limit`.
    pub fn write(&self) -> Result<()> {
        let root = self
            .dir
            .parent()
            .context("a checkpoint directory has a parent")?;
        std::fs::create_dir_all(root)
            .with_context(|| format!("{}: cannot create", root.display()))?;
        let name = self
            .dir
            .file_name()
            .context("a checkpoint directory has a name")?
            .to_string_lossy()
            .to_string();
        let tmp = root.join(format!(".tmp-{name}"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).ok();
        }
        std::fs::create_dir_all(&tmp)
            .with_context(|| format!("{}: cannot create", tmp.display()))?;
        match &self.lora {
            Some(l) => grpo_rollout::lora::save_peft(
                &self.model,
                l,
                &tmp.join("adapter"),
                &self.base_model,
            )?,
            None => grpo_rollout::save_hf_dir(
                &self.model,
                &self.tokenizer,
                &tmp.join("model"),
                self.model.dtype(),
            )?,
        }
        crate::optim::save_state(&self.optimizer, &tmp.join(OPT_FILE))?;
        if let Some(map) = &self.reference {
            candle_core::safetensors::save(map, tmp.join(REF_FILE))?;
        }
        if let Some(map) = &self.bema {
            candle_core::safetensors::save(map, tmp.join(crate::learner::bema::BEMA_FILE))?;
        }
        if let Some(map) = &self.teacher {
            candle_core::safetensors::save(map, tmp.join(crate::learner::sdpo::TEACHER_FILE))?;
        }
        if let Some(b) = &self.replay {
            b.save(&tmp)?;
        }
        if let Some((model, opt)) = &self.value {
            let dir = tmp.join(crate::learner::ppo::VALUE_DIR);
            grpo_rollout::save_hf_dir(model, &self.tokenizer, &dir, model.dtype())?;
            crate::optim::save_state(opt, &tmp.join(crate::learner::ppo::VALUE_OPT_FILE))?;
        }
        std::fs::write(
            tmp.join(STATE_FILE),
            serde_json::to_vec_pretty(&self.state)?,
        )?;
        std::fs::write(
            tmp.join("config.json"),
            serde_json::to_vec_pretty(&self.config)?,
        )?;
        if let Some((m, target)) = &self.merge {
            self.write_merged(&tmp, m, target)?;
        }
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir)?;
        }
        std::fs::rename(&tmp, &self.dir)
            .with_context(|| format!("{}: cannot rename into place", self.dir.display()))?;
        if self.save_total_limit > 0
            && let Some(run_dir) = root.parent()
        {
            let mut all = list_checkpoints(run_dir);
            while all.len() > self.save_total_limit {
                let (_, old) = all.remove(0);
                std::fs::remove_dir_all(&old).ok();
            }
        }
        Ok(())
    }
}

impl CheckpointJob {
    /// `[merge]` (TRL's `MergeModelCallback`): the policy — the checkpoint's `model/`, or a
    /// LoRA policy's merged weights in a scratch directory — merged with `target` into
    /// `tmp/merged`.
    fn write_merged(
        &self,
        tmp: &Path,
        m: &crate::config::MergeSection,
        target: &Path,
    ) -> Result<()> {
        let scratch = tmp.join(".policy-merged");
        let policy = match &self.lora {
            None => tmp.join("model"),
            Some(_) => {
                let merged = grpo_rollout::lora::merge(&self.model)?;
                grpo_rollout::save_hf_dir(&merged, &self.tokenizer, &scratch, merged.dtype())?;
                scratch.clone()
            }
        };
        let cfg = m.merge_config(&policy, target);
        let out = tmp.join("merged");
        grpo_rollout::merge::merge_dirs(&cfg, &out)
            .with_context(|| format!("[merge] with {}", target.display()))?;
        if scratch.exists() {
            std::fs::remove_dir_all(&scratch).ok();
        }
        Ok(())
    }
}

/// The events-thread sink that writes [`Event::Checkpoint`]s.
#[derive(Debug, Default)]
pub struct CheckpointWriter;

impl EventSink for CheckpointWriter {
    fn on_event(&mut self, event: &Event) -> Result<()> {
        match event {
            Event::Checkpoint(job) => job
                .write()
                .with_context(|| format!("checkpoint {}", job.dir.display())),
            _ => Ok(()),
        }
    }
}

impl Learner {
    /// The checkpoint of the current state (`checkpoints/step-N`), to hand to the writer.
    pub fn checkpoint_job(&mut self) -> Result<CheckpointJob> {
        let dir = self
            .run_dir
            .join("checkpoints")
            .join(format!("step-{}", self.state.step));
        let reference = match (&self.reference, self.reference_moves()) {
            (Some(r), true) => Some(r.weights().into_iter().collect()),
            _ => None,
        };
        let job = CheckpointJob {
            dir: dir.clone(),
            model: self.policy.model.snapshot_trainable()?,
            lora: self.policy.lora.clone(),
            base_model: self.base_model.clone(),
            tokenizer: self.tokenizer.clone(),
            optimizer: self.opt.state()?,
            reference,
            teacher: self.sdpo_teacher_state(),
            bema: self.bema.as_ref().map(crate::learner::bema::Bema::state),
            value: match &self.critic {
                Some(c) => Some((c.model.model.snapshot_trainable()?, c.opt.state()?)),
                None => None,
            },
            replay: self.replay_buffer.clone(),
            state: self.state.clone(),
            config: self.cfg.redacted_json(),
            save_total_limit: self.cfg.train.save_total_limit,
            merge: None,
        };
        self.checkpoints.retain(|p| p != &dir);
        self.checkpoints.push(dir);
        Ok(job)
    }

    /// Whether the reference changes during the run (TR-DPO's sync, BEMA's replacement): then
    /// checkpoints hold it.
    fn reference_moves(&self) -> bool {
        self.cfg.reference.sync_ref_model
            || self.cfg.bema.as_ref().is_some_and(|b| b.update_ref_model)
    }

    /// Writes the checkpoint of the current state now, on this thread.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let job = self.checkpoint_job()?;
        job.write()?;
        Ok(job.dir)
    }

    /// Restores weights, optimizer, reference and state from a checkpoint.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let state = read_state(dir)?;
        let weights: HashMap<String, Tensor> = match &self.policy.lora {
            Some(_) => {
                let p = dir.join("adapter").join("adapter_model.safetensors");
                let raw = candle_core::safetensors::load(&p, &self.device)
                    .with_context(|| format!("{}: cannot read the adapter", p.display()))?;
                // Phi-3's fused modules: their parts' tensors, as the variables hold them.
                let raw = grpo_rollout::lora::from_peft_layout(&self.policy.model.cfg, raw)
                    .with_context(|| p.display().to_string())?;
                // PEFT keys carry the `base_model.model.` prefix and no adapter name.
                let mut m = HashMap::new();
                // Our LoRA variables are named by their PEFT keys (a fused module's parts by
                // their own names).
                for (k, _) in self.opt.vars() {
                    let t = raw
                        .get(k)
                        .with_context(|| format!("{}: no `{k}`", p.display()))?;
                    m.insert(k.clone(), t.clone());
                }
                m
            }
            None => {
                let d = dir.join("model");
                let cfg = &self.policy.model.cfg;
                let dtype = self.policy.model.dtype();
                grpo_rollout::loader::read_model_weights(&d, cfg, dtype, &self.device)?
                    .into_iter()
                    .collect()
            }
        };
        set_vars(self.opt.vars(), &weights, dir)?;
        // Tied heads: the model shares the embedding tensor with its var, so nothing else to do.
        self.opt.load(&dir.join(OPT_FILE))?;
        if let Some(b) = self.bema.as_mut() {
            let p = dir.join(crate::learner::bema::BEMA_FILE);
            let map = candle_core::safetensors::load(&p, &self.device)
                .with_context(|| format!("{}: cannot read the BEMA state", p.display()))?;
            b.restore(&map)
                .with_context(|| format!("{}: not this run's BEMA state", p.display()))?;
        }
        if self.reference_moves()
            && let Some(r) = &self.reference
        {
            let p = dir.join(REF_FILE);
            let map = candle_core::safetensors::load(&p, &self.device)
                .with_context(|| format!("{}: cannot read", p.display()))?;
            self.reference = Some(Transformer::from_weights_like(r, &map)?);
        }
        if self.sdpo_teacher_state().is_some() {
            let p = dir.join(crate::learner::sdpo::TEACHER_FILE);
            let map = candle_core::safetensors::load(&p, &self.device)
                .with_context(|| format!("{}: cannot read SDPO's EMA teacher", p.display()))?;
            self.restore_sdpo_teacher(map)?;
        }
        if let Some(c) = self.critic.as_mut() {
            c.restore(dir)?;
        }
        let size = self.cfg.loss.replay_buffer_size;
        // A checkpoint of a run without replay: the buffer starts empty.
        if size > 0 && dir.join(crate::stages::replay::REPLAY_FILE).exists() {
            let g = self.cfg.rollout.num_generations;
            self.replay_buffer = Some(crate::stages::replay::ReplayBuffer::load(dir, g, size)?);
        }
        self.state = TrainerState {
            max_steps: self.state.max_steps,
            ..state
        };
        Ok(())
    }
}

/// Sets each variable of `vars` to its weight in `weights` (read from checkpoint `dir`), each
/// kept in its own dtype (an f32 head beside bf16 layers); a missing weight or another shape is
/// an error naming `dir`.
pub(crate) fn set_vars(
    vars: &[(String, candle_core::Var)],
    weights: &HashMap<String, Tensor>,
    dir: &Path,
) -> Result<()> {
    for (k, var) in vars {
        let t = weights
            .get(k)
            .with_context(|| format!("{}: checkpoint has no weight `{k}`", dir.display()))?;
        if t.dims() != var.dims() {
            bail!(
                "{}: `{k}` has shape {:?}, the model's is {:?}",
                dir.display(),
                t.dims(),
                var.dims()
            );
        }
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// A checkpoint's `trainer_state.json`.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let p = dir.join(STATE_FILE);
    let text = std::fs::read(&p).with_context(|| {
        format!(
            "{}: not a complete checkpoint (no {STATE_FILE})",
            dir.display()
        )
    })?;
    serde_json::from_slice(&text).with_context(|| format!("{}: invalid", p.display()))
}

/// Complete checkpoints of a run directory, oldest (lowest step) first.
pub fn list_checkpoints(run_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(run_dir.join("checkpoints")) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(n) = name
                .strip_prefix("step-")
                .and_then(|n| n.parse::<usize>().ok())
                && e.path().join(STATE_FILE).exists()
            {
                out.push((n, e.path()));
            }
        }
    }
    out.sort();
    out
}

/// Copies a directory tree.
pub fn copy_dir(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst).with_context(|| format!("{}: cannot create", dst.display()))?;
    for entry in
        std::fs::read_dir(src).with_context(|| format!("{}: cannot read", src.display()))?
    {
        let entry = entry?;
        let to = dst.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &to)?;
        } else {
            std::fs::copy(entry.path(), &to)
                .with_context(|| format!("{}: cannot write", to.display()))?;
        }
    }
    Ok(())
}
