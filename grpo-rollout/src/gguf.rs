//! GGUF (llama.cpp) files: weights dequantised to our layout, tokenizer and chat template from
//! the metadata.

use std::path::Path;

use candle_core::{DType, Device, Result, bail};

use crate::config::ModelConfig;
use crate::model::WeightMap;
use crate::tokenizer::Tokenizer;

/// Reads a GGUF file: config, transformers-named weights and tokenizer.
pub fn load_gguf(
    path: &Path,
    _dtype: DType,
    _device: &Device,
) -> Result<(ModelConfig, WeightMap, Tokenizer)> {
    bail!(
        "{}: GGUF loading is not available in this build yet",
        path.display()
    )
}
