"""What the gen_*_reference.py scripts share: the left-padded rows with per-row position ids,
their log-probs, a greedy continuation, a PEFT `all-linear` adapter with its adapted log-probs,
the micro models' tokenizer. Imported by those scripts (run from any directory)."""
import inspect, os, runpy, shutil, sys

import torch
from transformers import AutoModelForCausalLM


def padded(rows):
    """`rows` left-padded with 0: ids, attention mask, per-row position ids."""
    length = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def padded_logprobs(model, rows, t):
    """The log-probs (float64) of the last `t` tokens of `rows`, left-padded; the graph kept."""
    ids, mask, pos = padded(rows)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -t - 1:-1, :]
    return torch.log_softmax(logits.double(), -1).gather(-1, ids[:, -t:].unsqueeze(-1)).squeeze(-1)


def greedy(model, prompt, new):
    """`new` greedy tokens after `prompt` through transformers' cache (no stop token)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def copy_tokenizer(path):
    """The micro models' tokenizer (fixtures/arch-deepseekv2-micro's) into `path`."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(os.path.dirname(path), "arch-deepseekv2-micro", f), path)


def peft_adapter(path, out, rows, t, scale=1.0):
    """A PEFT LoRA adapter (r 2, alpha 4) on every linear map of the model at `path`
    (`all-linear`), random A and B (times `scale`), saved as `out`; returns the adapted model's
    log-probs of `rows` (float32 model)."""
    from peft import LoraConfig, get_peft_model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(1)
    pm = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                          init_lora_weights=False)).eval()
    if scale != 1.0:
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.mul_(scale)
    shutil.rmtree(out, ignore_errors=True)
    pm.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))
    with torch.no_grad():
        return padded_logprobs(pm, rows, t).tolist()


def in_float64(module, functions=(), classes=()):
    """transformers' model code (`module`) with the float32 islands of its `functions` and of its
    `classes`' forwards (casts to float32, softmaxes in float) in float64: a float64 model then
    computes in float64 throughout (the RoPE angles stay float32, as ours)."""
    for name in functions:
        src = inspect.getsource(getattr(module, name)).replace("torch.float32", "torch.float64")
        exec("\n".join(l for l in src.split("\n") if not l.startswith("@")), module.__dict__)
    for cls in classes:
        src = inspect.getsource(cls.forward).replace("torch.float32", "torch.float64")
        src = src.replace(".float()", ".double()").replace("dtype=torch.float,", "dtype=torch.float64,")
        ns = {}
        exec("\n".join(l[4:] for l in src.split("\n") if not l.strip().startswith("@")), module.__dict__, ns)
        cls.forward = ns["forward"]


def gated_delta_in_float64(module, prefix):
    """`in_float64` for transformers' Qwen3.5 (`module`, its classes named `{prefix}...`): the
    delta rule, the gated norm, the decays, the `1 + w` RMSNorms, the eager softmax, an MoE
    router's softmax."""
    classes = [getattr(module, prefix + c) for c in ["RMSNormGated", "GatedDeltaNet", "TopKRouter"]
               if hasattr(module, prefix + c)]
    in_float64(module, ["torch_chunk_gated_delta_rule", "eager_attention_forward"], classes)
    getattr(module, prefix + "RMSNorm").forward = lambda self, x: self._norm(x) * (1.0 + self.weight)


def llama_cpp_converter(llama_cpp):
    """llama.cpp's `convert_hf_to_gguf.py` from the checkout `llama_cpp` (its `conversion` package
    importable afterwards, to patch), as `convert(model_dir, out_file, *flags)` (f32). The micro
    models' tokenizer is a plain byte-level BPE whose hash the converter does not know: its
    pre-tokenizer is named `gpt-2`; the rest of the conversion runs as llama.cpp runs it."""
    sys.path.insert(0, llama_cpp)
    sys.path.insert(0, os.path.join(llama_cpp, "gguf-py"))
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"

    def convert(model_dir, out_file, *flags):
        sys.argv = ["convert_hf_to_gguf.py", model_dir, *flags, "--outtype", "f32", "--outfile", out_file]
        runpy.run_path(os.path.join(llama_cpp, "convert_hf_to_gguf.py"), run_name="__main__")
    return convert
