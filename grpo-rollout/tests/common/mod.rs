//! Fixtures shared by grpo-rollout's test binaries.

use candle_core::{Device, Tensor};

/// GRPO's shared-prompt batch: two distinct prompts (left-padded ids and mask), four
/// completions (right-padded ids and mask) and the prompt each completion continues.
pub struct SharedPromptBatch {
    pub pids: Tensor,
    pub pmask: Tensor,
    pub prompt_of: Vec<u32>,
    pub cid: Tensor,
    pub cmask: Tensor,
}

pub fn shared_prompt_batch() -> SharedPromptBatch {
    let dev = Device::Cpu;
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 2, 33], vec![8, 3, 20, 11, 44, 1, 7]];
    let (pids, pmask) = grpo_rollout::generate::left_pad(&prompts, 0, &dev).unwrap();
    let comps: Vec<Vec<u32>> = vec![vec![12, 40, 3], vec![9, 9, 27, 5], vec![31], vec![4, 22]];
    let cl = comps.iter().map(|c| c.len()).max().unwrap();
    let (mut cid, mut cmask) = (Vec::new(), Vec::new());
    for c in &comps {
        for j in 0..cl {
            cid.push(c.get(j).copied().unwrap_or(0));
            cmask.push(u32::from(j < c.len()));
        }
    }
    SharedPromptBatch {
        pids,
        pmask,
        prompt_of: vec![0, 1, 1, 0],
        cid: Tensor::from_vec(cid, (comps.len(), cl), &dev).unwrap(),
        cmask: Tensor::from_vec(cmask, (comps.len(), cl), &dev).unwrap(),
    }
}
