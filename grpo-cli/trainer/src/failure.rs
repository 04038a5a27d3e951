//! How a run ends when something fails: out of device memory gets one line naming what lowers
//! memory; any failure after a completed step leaves a checkpoint to resume from.

use std::path::Path;

use crate::config::TrainConfig;

/// True when `e` (or a cause) says a device ran out of memory: CUDA's
/// `CUDA_ERROR_OUT_OF_MEMORY`, cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`, an allocator's "out of
/// memory".
pub fn is_out_of_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        let s = c.to_string();
        s.contains("OUT_OF_MEMORY") || s.contains("ALLOC_FAILED") || s.contains("out of memory")
    })
}

/// The one line a run that ran out of device memory ends with: where, the micro-batch, what
/// lowers memory, and the checkpoint to continue from.
pub fn out_of_memory_message(cfg: &TrainConfig, step: usize, checkpoint: Option<&Path>) -> String {
    let mut ways = vec![format!(
        "a smaller `train.per_device_train_batch_size` (now {} completions per micro-batch)",
        cfg.micro_batch()
    )];
    if !cfg.train.gradient_checkpointing {
        ways.push("`train.gradient_checkpointing = true`".into());
    }
    if cfg.model.lora.is_none() {
        ways.push("LoRA adapters (`[model.lora]`)".into());
    }
    if cfg.model.lora.is_none() && !cfg.optim.optim.eight_bit() {
        ways.push("8-bit AdamW state (`optim.optim = \"adamw_8bit\"`)".into());
    }
    if cfg.model.dtype == grpo_rollout::Dtype::F32 {
        ways.push("`model.dtype = \"bf16\"`".into());
    }
    let tail = match checkpoint {
        Some(c) => format!(
            "; checkpoint {} saved (continue with --resume)",
            c.display()
        ),
        None => "; no step had completed, nothing saved".into(),
    };
    format!(
        "out of memory on {} in step {}: lower it with {}{tail}",
        cfg.model.device,
        step + 1,
        ways.join(", or ")
    )
}
