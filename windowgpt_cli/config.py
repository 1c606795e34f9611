"""One typed configuration for every stage, with the reference script's defaults.

Field names are the reference's `Hyperparameters` attributes in lower case, so a reference
setting `TTT_LR=0.004` is the flag `--ttt-lr 0.004` here. The whole `RunConfig` is saved as
JSON next to every artifact, and each stage rebuilds the model from it alone.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError, SettingError


def setting(default: Any, help: str) -> Any:
    """A configuration field and its one-sentence documentation, which the command line's
    help shows (with the default) for the field's flag."""
    return field(default=default, metadata={"help": help})


def setting_help(group: str, name: str) -> str:
    """The documentation of a field ("" when it has none)."""
    fields = {f.name: f for f in dataclasses.fields(GROUP_TYPES[group])}
    return fields[name].metadata.get("help", "")


@dataclass
class ModelConfig:
    """The model's shape and the features it uses."""

    vocab_size: int = setting(1024, "Tokens in the vocabulary; must match the tokenizer.")
    num_layers: int = setting(11, "Transformer blocks.")
    model_dim: int = setting(512, "Width of the residual stream.")
    num_heads: int = setting(8, "Query heads per attention layer; must divide model_dim.")
    num_kv_heads: int = setting(4, "Key/value heads per attention layer (grouped-query attention); must divide "
                                   "num_heads.")
    mlp_mult: float = setting(3.0, "MLP hidden width as a multiple of model_dim.")
    tie_embeddings: bool = setting(True, "Use the token embedding as the output layer too.")
    tied_embed_init_std: float = setting(0.005, "Standard deviation of the tied embedding's initialization.")
    logit_softcap: float = setting(30.0, "Logits are squashed into (-cap, cap) by cap * tanh(logits / cap).")
    rope_base: float = setting(10000.0, "Base of the rotary embeddings' frequencies.")
    rope_dims: int = setting(16, "Rotary dimensions per head; 0 rotates the whole head.")
    qk_gain_init: float = setting(1.5, "Initial per-head gain on the normalized queries.")
    ln_scale: bool = setting(True, "Scale each block's normed input by 1/sqrt(layer + 1).")
    negative_slope: float = setting(0.5, "LeakyReLU slope before the square in the MLP.")
    xsa_last_n: int = setting(4, "Exclusive self-attention on the last N layers; 0 = none.")
    bigram_vocab_size: int = setting(2048, "Hash buckets of the BigramHash embedding; 0 disables it.")
    bigram_dim: int = setting(128, "Width of the BigramHash embedding before its projection.")
    ve_enabled: bool = setting(True, "Add the shared value embedding to the values of ve_layers.")
    ve_dim: int = setting(128, "Width of the value embedding before its projection.")
    ve_layers: tuple[int, ...] = setting((9, 10), "Layers whose values get the value embedding (comma-separated).")
    window_attn_size: int = setting(0, "Tokens each query sees on the windowed layers; 0 = full causal attention "
                                       "everywhere.")
    window_attn_layers: tuple[int, ...] = setting((2, 4, 6, 8, 10), "Layers that attend in windows when "
                                                  "window_attn_size > 0 (comma-separated).")
    num_sink_tokens: int = setting(0, "Windowed layers also always see the first N tokens; 0 = none.")
    rope_train_seq_len: int = setting(2048, "Rotary tables are exact up to this length and NTK-rescaled beyond "
                                            "it; training sets it to its longest sequence length.")
    rope_scaling: str = setting("ntk", "How rotary tables stretch beyond rope_train_seq_len: ntk (the base "
                                       "rescaled, as the reference) or yarn (YaRN: low frequencies interpolated, "
                                       "high ones kept, the rotated channels scaled by 0.1 ln(s) + 1).")
    skip_gates: bool = setting(False, "Gate each U-Net skip: a decoder block's input becomes g x + (1 - g) w skip, "
                                      "g = sigmoid of a learned vector (zero at first: an even blend); off: x + w "
                                      "skip, as the reference.")
    attn_out_gate_width: int = setting(0, "Sparse attention output gate: each head's output times sigmoid(scale "
                                          "w . x), x the first N channels of the attention's normed input, w "
                                          "learned per head (zero at first); 0 = no gate.")
    attn_out_gate_scale: float = setting(1.0, "The sparse attention output gate's scale.")
    parallel_start_layer: int = setting(0, "Blocks from this layer on (a decoder layer) run on two lanes: the "
                                           "attention reads one, the MLP the other, side by side, and a learned "
                                           "mix adds both to each; the output is the lanes' mean. 0 = none.")
    parallel_mlp_reads_x0: bool = setting(True, "On the parallel lanes the MLP reads its lane mixed with x0 by "
                                                "the block's resid_mix, as the attention reads its own; off: its "
                                                "lane alone, as the final records' code.")
    recur_layers: tuple[int, ...] = setting((), "Depth recurrence: consecutive layers (comma-separated) that run "
                                                "recur_count times in a row once looping is on (in training after "
                                                "recur_start_fraction, in scoring always); empty = none.")
    recur_count: int = setting(1, "Times the recur_layers run in all once looping is on; 1 = once.")
    doc_boundary_token: int = setting(-1, "A token that begins each document (1 = BOS): SmearGate and BigramHash "
                                          "treat a position holding it as a sequence's first, so no document "
                                          "reaches into the next; -1 = none, as the reference.")
    smear_gate_width: int = setting(0, "0 = the reference's SmearGate (a learned per-channel blend of each normed "
                                       "embedding with the one before); N = the final records' gate, by token: "
                                       "x + scale * sigmoid(w . x[:N]) * x_prev on the embeddings before their "
                                       "norm (w and scale zero at first).")

    def block_order(self, looping: bool = True) -> list[int]:
        """The blocks in the order they run: each once, or with looping, recur_layers
        recur_count times in a row."""
        order = list(range(self.num_layers))
        if not looping or not self.recur_layers or self.recur_count <= 1:
            return order
        first, last = self.recur_layers[0], self.recur_layers[-1]
        return order[:first] + list(self.recur_layers) * self.recur_count + order[last + 1:]

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_dim(self) -> int:
        return int(self.mlp_mult * self.model_dim)


@dataclass
class DataConfig:
    """Where tokens and the tokenizer come from (stored as absolute paths)."""

    data_path: str = setting("", "Directory of the fineweb_{train,val}_*.bin shards.")
    tokenizer_path: str = setting("", "SentencePiece model; empty = DATA_PATH/tokenizer.model.")
    tokenizer_meta_path: str = setting("", "Byte tables (.meta.npz) for bits per byte; empty = the tokenizer's "
                                           ".meta.npz when it exists, else computed from the tokenizer.")


@dataclass
class OptimConfig:
    """Muon for the parameter banks, AdamW for embeddings and control tensors."""

    embed_lr: float = setting(0.6, "AdamW learning rate of the token embeddings when they are not tied.")
    head_lr: float = setting(0.008, "Adam learning rate of the output layer when it is not tied.")
    tied_embed_lr: float = setting(0.035, "AdamW learning rate of the token embeddings when they are tied.")
    matrix_lr: float = setting(0.025, "Muon learning rate of the attention and MLP matrices.")
    scalar_lr: float = setting(0.025, "AdamW learning rate of control tensors and small projections.")
    muon_momentum: float = setting(0.99, "Muon momentum once warmed up.")
    muon_backend_steps: int = setting(5, "Newton-Schulz iterations per Muon update.")
    muon_ns_coefficients: str = setting("reference", "The Newton-Schulz polynomial of each Muon iteration: "
                                        "reference (3.4445, -4.7750, 2.0315 at every step) or polar_express "
                                        "(the Polar Express paper's coefficients, one set per iteration).")
    muon_row_normalize: bool = setting(False, "Scale each row of every Muon update to unit length before "
                                              "Newton-Schulz (MuonEq-R, as the final records' Muon); off = the "
                                              "reference's update.")
    muon_momentum_warmup_start: float = setting(0.92, "Muon momentum at step 0, raised linearly to muon_momentum.")
    muon_momentum_warmup_steps: int = setting(1500, "Steps over which Muon momentum warms up.")
    muon_wd: float = setting(0.04, "Muon's decoupled weight decay.")
    beta1: float = setting(0.9, "Adam(W) decay of the first moment.")
    beta2: float = setting(0.95, "Adam(W) decay of the second moment.")
    adam_eps: float = setting(1e-8, "Adam(W) epsilon.")
    adam_wd: float = setting(0.04, "AdamW weight decay.")
    embed_wd: float = setting(-1.0, "AdamW weight decay of the token tables (the embedding, BigramHash's and the "
                                    "value embeddings'); -1 = adam_wd, as the reference.")
    grad_clip_norm: float = setting(0.3, "Clip the gradient to this global norm; 0 = no clipping.")


@dataclass
class TrainConfig:
    """The training loop, its schedule and its bookkeeping."""

    seed: int = setting(1337, "Seed of the initialization (and of the batch sampler when data_seed is -1).")
    data_seed: int = setting(-1, "Seed of the batch sampler; -1 = seed.")
    iterations: int = setting(20000, "Optimizer steps the schedule is planned for.")
    warmdown_iters: int = setting(3500, "Steps of linear learning-rate decay at the end of the schedule.")
    warmup_steps: int = setting(20, "Compile/warm-up steps (one micro-batch each) whose updates are then undone; "
                                    "0 = none.")
    train_batch_tokens: int = setting(786_432, "Global tokens per optimizer step.")
    train_seq_len: int = setting(2048, "Tokens per training sequence.")
    train_seq_len_long: int = setting(0, "Sequence length of the last num_gpus_long ranks; 0 = every rank trains "
                                         "at train_seq_len.")
    num_gpus_long: int = setting(0, "The last N ranks train at train_seq_len_long; 0 = none.")
    grad_accum_steps: int = setting(0, "Micro-batches per step on each rank; 0 = 8 // world_size, as the "
                                       "reference.")
    micro_batches_per_pass: int = setting(0, "Micro-batches that run together in one forward and backward (the "
                                             "same gradient, fewer and larger kernels); 0 = on CUDA as many as "
                                             "fit in 70% of the GPU's memory, elsewhere 1.")
    max_wallclock_seconds: float = setting(600.0, "Stop training after this many seconds, with the warm-down "
                                                  "fitted to the cap; 0 = no cap.")
    val_loss_every: int = setting(4000, "Validate every N steps (and always at the end); 0 = only at the end.")
    train_log_every: int = setting(500, "Log the training loss every N steps (and the first 10); 0 = never.")
    val_batch_size: int = setting(524_288, "Global tokens per validation batch.")
    ema_decay: float = setting(0.997, "Decay of the weights' exponential moving average (what export uses).")
    ema_warmup: bool = setting(True, "Decay min(ema_decay, (1 + step) / (10 + step)), so that a short run's EMA "
                                     "follows its weights; off reproduces the reference.")
    warmdown_fraction: float = setting(0.0, "Warm-down as a fraction of the run: of iterations, or of the "
                                            "budget under a wallclock cap; 0 = warmdown_iters steps.")
    recur_start_fraction: float = setting(0.0, "Depth recurrence (model.recur_layers): training runs those layers "
                                                "once until this fraction of its iterations, or of its wallclock "
                                                "budget under a cap, has passed, then recur_count times.")
    fused_cross_entropy: bool = setting(False, "The training loss's soft cap and cross-entropy as one Triton "
                                                "kernel forward and one backward (CUDA), each reading the logits "
                                                "once; off: as torch.compile fuses them.")
    loss_chunk_rows: int = setting(0, "The output layer's product, the soft-capped cross-entropy and their "
                                      "gradients in one op, this many rows at a time (the fused "
                                      "cross-entropy's kernels; CUDA), so that the logits of a whole batch are "
                                      "never stored; 0 = the logits whole.")
    fused_mlp: str = setting("auto", "The MLP's LeakyReLU² in the epilogues of the training step's products: "
                                     "the activation as the up product is stored, its derivative as the "
                                     "gradient comes back through the down product. quack (the quack-kernels "
                                     "package's CuTe GEMMs, which flash-attn-4 installs; Hopper or Blackwell; "
                                     "negative_slope in 0..1), triton (windowgpt's kernels; Hopper or later), "
                                     "off (cuBLAS's products and the compiler's element-wise kernels), or auto: "
                                     "quack's where they run and the MLP's products are not float8, else off.")
    keep_mlp_activation: str = setting("auto", "With fused_mlp quack: the forward's activation kept until the "
                                               "backward, where the down projection's weight gradient reads the "
                                               "very activation the forward multiplied and the product that "
                                               "brings the gradient back stores the gradient alone (on); or not "
                                               "kept, that product storing it again from the up product as stored "
                                               "in bfloat16 (off: a [tokens x mlp_dim] bfloat16 tensor a layer "
                                               "less held between forward and backward, a pass more over one). "
                                               "auto: on.")
    copy_kv_heads: str = setting("auto", "In the training step, the layers that attend in windows through FA4 "
                                         "(attn_backend fa4) handed keys and values of as many heads as the "
                                         "queries: each key head stored once per query head of its group by the "
                                         "heads' kernel, the values repeated where they are made, so that FA4's "
                                         "backward writes their gradients directly instead of summing each "
                                         "group's in float32 and converting them after. The same function, "
                                         "rounded otherwise. on, off, or auto: on.")
    stack_qkv: str = setting("auto", "In the training step, each block's query, key and value matrices stacked "
                                    "into one product forward (the heads' kernels read its slices in place), "
                                    "which reads the normed input once where three products read it three "
                                    "times; backward each slice's gradient goes through its own matrix, as "
                                    "with three products (joined, the three would be copied into one tensor "
                                    "as wide as the product). qk: on, and with fused_head_prep the queries' and "
                                    "keys' steps one op, whose gradient is one tensor for one product back "
                                    "(two in all, the values' the other). The same function, rounded "
                                    "otherwise. on, off, qk, or auto: qk for a CUDA device.")
    fold_output_scales: str = setting("auto", "In the training step, each block's attention and MLP output "
                                              "scales multiplied into the rows of their output projections (a "
                                              "product over [dim x width] weights) instead of into the "
                                              "[tokens x dim] outputs, each way: the same function, rounded "
                                              "elsewhere in bfloat16. on, off (the reference's order), or auto: "
                                              "on for a CUDA device, off elsewhere.")
    residual_in_product: bool = setting(False, "In the training step, each block's input added to its attention "
                                               "output inside the output projection's product (torch.addmm; cuBLAS "
                                               "adds it in the product's epilogue) instead of in the norm kernel "
                                               "after it: the norm reads and writes one [tokens x dim] tensor fewer, "
                                               "the product reads one more, the sum is rounded to bfloat16 once. "
                                               "Where the output scales fold (fold_output_scales) only.")
    fused_head_prep: str = setting("auto", "Each query and key head's RMSNorm, partial rotation and gain in the "
                                          "training step as one Triton kernel forward and one backward (an op "
                                          "the compiler keeps whole), each reading the heads once, where the "
                                          "compiler's kernels pass over the queries four times forward and "
                                          "three times back. on, off (the compiler's kernels), auto: on for a "
                                          "CUDA device, or apart: on, the forward computing each head's rotated "
                                          "channels in a block of their own (the rotation's arithmetic on those "
                                          "channels alone; the same numbers). Runs only where Triton does (CUDA).")
    fused_xsa: str = setting("auto", "XSA and the sparse output gate over the attention's output in the training "
                                    "step as one Triton kernel forward and one backward (an op the compiler "
                                    "keeps whole), each reading the heads and their values once. on, off (the "
                                    "compiler's kernels), or auto: on for a CUDA device. Either runs only where "
                                    "Triton does (CUDA), and only on layers with XSA.")
    fp8_mlp: bool = setting(False, "The MLP's products in the training step in float8 (e4m3, a power-of-two "
                                   "scale per row; cuBLAS, compute capability 8.9 or later): forward and the "
                                   "gradients to their inputs, the weights' gradients in bfloat16. Rounds "
                                   "training's products more coarsely; validation and scores stay bfloat16's.")
    fp8_attention: bool = setting(False, "The attention's projections (queries, keys and values; the output) in "
                                         "the training step in float8, as fp8_mlp does the MLP's.")
    fp8_mlp_kernels: bool = setting(True, "With fp8_mlp, the MLP's LeakyReLU² and the rounding of its rows to "
                                          "float8 in one Triton kernel each way (CUDA), reading each row once; "
                                          "off: the compiler's kernels. The same numbers, to rounding.")
    qat_start_fraction: float = setting(0.0, "Quantization-aware training: once this fraction of the iterations, "
                                              "or of the wallclock budget under a cap, has passed, each training "
                                              "forward rounds the int6 matrices to the grid quantize will use (the "
                                              "quant settings'; gradients pass straight through); validation sees "
                                              "them unrounded. 0 = never.")
    min_lr_fraction: float = setting(0.0, "The warm-down's floor: the learning rate falls linearly to this "
                                          "fraction of its peak; 0 = to zero, the reference's.")
    warmdown_max_fraction: float = setting(0.5, "Under a wallclock cap, the warm-down lasts warmdown_iters steps "
                                                "at the current pace but at most this fraction of the budget; 1.0 "
                                                "= the reference.")
    swa_enabled: bool = setting(True, "Average weight snapshots (SWA) once the learning-rate scale is below 0.2.")
    swa_every: int = setting(50, "Steps between SWA snapshots.")
    checkpoint_every: int = setting(0, "Write a checkpoint every N steps; 0 = only at the end.")
    keep_checkpoints: int = setting(0, "Keep the last K periodic checkpoints as checkpoint-STEP.pt beside "
                                       "checkpoint.pt, to go back to; 0 = only checkpoint.pt.")
    device: str = setting("auto", "auto (CUDA when available), cpu or cuda.")
    cpu_threads: int = setting(0, "Threads of torch's CPU work in every stage (train, quantize, eval, eval-ttt, "
                                  "generate); 0 = torch's choice, one per core. A small model runs faster on "
                                  "one (threads contend on a busy machine), and CPU results depend on the "
                                  "count in their last digits.")
    attn_backend: str = setting("auto", "Attention kernels: auto, fa3, fa4 (FlashAttention-4 for every layer, "
                                        "the sinks merged by Triton; auto's choice for training where FA4 is "
                                        "installed on Hopper or Blackwell), flex, triton, triton_fa4 (Triton for "
                                        "windowed layers, FA4 for full ones) or sdpa.")
    compile: bool = setting(True, "torch.compile the model (on CUDA only).")
    compile_tuning: str = setting("default", "What torch.compile tunes in the training step: default (its "
                                             "element-wise kernels), gemm (also Triton matrix-product templates "
                                             "against cuBLAS for each product's shape, fusing the element-wise "
                                             "work around a chosen template into it) or full (gemm, and "
                                             "coordinate-descent tuning of every kernel): a longer warm-up, "
                                             "possibly a faster step.")
    compile_mix_order: bool = setting(True, "Let torch.compile fuse a reduction along each row (a norm's "
                                            "backward) with the per-channel sums over the same rows (scale, mix "
                                            "and gate gradients) into one kernel; off: the sums as kernels of "
                                            "their own (where many tensors meet, as in the parallel lanes' "
                                            "backward, the fused kernel can spill its registers).")
    compile_multi_kernel: bool = setting(False, "Let torch.compile build each reduction along rows of up to "
                                                "16,384 columns both holding a row whole in registers and looping "
                                                "over it, and keep the faster at its first call (Inductor's "
                                                "multi-kernels): rows over 1,024 columns, as the MLP's 1,536, "
                                                "may then be read once instead of twice; a longer warm-up.")
    sample_every: int = setting(0, "Log a short greedy sample every N steps; 0 = never.")
    sample_prompt: str = setting("The", "The prompt of those samples.")
    logger: str = setting("none", "Also send the metrics to: none, tensorboard or wandb.")


@dataclass
class EvalConfig:
    """How eval scores the validation tokens."""

    eval_seq_len: int = setting(2048, "Tokens per evaluation window.")
    eval_stride: int = setting(64, "Windows every STRIDE tokens, each scoring its last STRIDE; 0 = consecutive "
                                   "sequences.")
    eval_batch_seqs: int = setting(0, "Windows per forward pass; 0 = as many as fit in memory (the reference: "
                                      "32).")


@dataclass
class QuantConfig:
    """How quantize compresses the weights into a .ptz."""

    quant_clip_range: int = setting(31, "int6 codes lie in [-clip, clip].")
    quant_passthrough_max_numel: int = setting(65_536, "Tensors of at most this many elements are stored as "
                                                       "float16, not quantized.")
    use_gptq: bool = setting(False, "Quantize the attention and MLP matrices with GPTQ on calibration Hessians.")
    gptq_calib_samples: int = setting(64, "GPTQ calibration batches, each of train_batch_tokens / grad_accum "
                                          "tokens.")
    gptq_block_size: int = setting(128, "Columns GPTQ quantizes per block.")
    gptq_percdamp: float = setting(0.01, "GPTQ adds this fraction of the Hessian's mean diagonal to its "
                                         "diagonal.")
    gptq_reserve_seconds: float = setting(14.0, "Under a wallclock cap, training with use_gptq stops this long "
                                                "before it to collect GPTQ's Hessians inside the budget (the "
                                                "reference's GPTQ_RESERVE_MS).")
    quant_embed_bits: int = setting(8, "Bits of the token embedding's codes (one scale per row); 8 = the "
                                       "reference's int8.")
    quant_mlp_clip_sigmas: float = setting(0.0, "Clip each MLP matrix row at this many standard deviations of "
                                                "its weights (the row's scale: that / the clip range, also where "
                                                "no weight reaches it: a wider clip, a coarser grid and fewer "
                                                "bytes); 0 = the reference's search over five percentiles.")
    quant_attn_clip_sigmas: float = setting(0.0, "The same for the attention matrices; 0 = the reference's "
                                                 "percentile search.")
    quant_embed_clip_sigmas: float = setting(0.0, "The same for the token embedding; 0 = the reference's "
                                                  "99.99984th percentile.")
    quant_gptq_embed: bool = setting(False, "With GPTQ, quantize the token embedding by GPTQ too, on the "
                                            "Hessian of the output layer's input (tied embeddings).")
    quant_scale_floor: bool = setting(True, "Row scales found by the percentile searches are at least 1 / the "
                                            "codes' limit, as the reference's; off: a row whose largest weight "
                                            "is under 1 gets a grid as fine as its weights (less error, more "
                                            "bytes). k-sigma scales have no floor.")
    quant_gates_int8: bool = setting(False, "Store the small 2-D control tensors (gates, skip weights) as int8 "
                                            "codes with one scale per row instead of floats.")
    quant_lqer_rank: int = setting(0, "Rank of LQER's correction of the quantization error (W ~ codes x scales "
                                      "+ A B, the factors quantized); 0 = none.")
    quant_lqer_top_k: int = setting(3, "LQER corrects the K quantized matrices of the largest error.")
    quant_lqer_factor_bits: int = setting(4, "Bits of LQER's factor codes (asymmetric, per group).")
    quant_lqer_group_size: int = setting(64, "Values of an LQER factor sharing one scale and offset.")
    quant_fit_budget: bool = setting(False, "When the code plus the compressed model exceed quantize's --budget, "
                                            "zero the codes of +-1 whose loss adds the least error (weighted by "
                                            "the calibration Hessian) until they fit; off: the artifact is "
                                            "written as it is and quantize fails.")


@dataclass
class TTTConfig:
    """Score-first test-time training during evaluation."""

    ttt_lr: float = setting(0.002, "SGD learning rate at the first chunk, decayed to 0 over the chunks (cosine).")
    ttt_epochs: int = setting(3, "Passes over each scored chunk; 0 = score only, no training.")
    ttt_chunk_tokens: int = setting(32768, "Validation tokens per chunk: scored first, then trained on.")
    ttt_seq_len: int = setting(0, "Tokens per TTT window and training sequence; 0 = train_seq_len, as the reference.")
    ttt_freeze_blocks: int = setting(2, "The first N blocks stay frozen; 0 = train every block.")
    ttt_freeze_bank_slices: bool = setting(True, "Also freeze the frozen blocks' slices of the parameter banks "
                                                 "(the reference freezes only their scalars).")
    ttt_momentum: float = setting(0.9, "SGD momentum.")
    ttt_batch_seqs: int = setting(32, "Sequences per training batch.")
    ttt_grad_clip: float = setting(1.0, "Clip the gradient to this global norm.")
    ttt_cuda_graphs: bool = setting(True, "On CUDA in one process, replay each training step as a CUDA graph "
                                          "(the same numbers, fewer kernel launches); off: eager steps.")
    ttt_method: str = setting("chunks", "chunks: the reference's (the stream in chunks, each scored, then trained on "
                                        "with SGD); lora: per-document LoRA adapters, reset at each document, "
                                        "trained on each scored chunk of it, with optional global phases.")
    ttt_lora_rank: int = setting(80, "lora: rank of each adapter.")
    ttt_lora_targets: str = setting("q,k,v,o,up,down,head", "lora: the matrices adapted (comma-separated: q, k, v, "
                                                            "o, up, down of every block, head: the output layer).")
    ttt_lora_lr: float = setting(3e-4, "lora: the adapters' AdamW learning rate.")
    ttt_lora_beta1: float = setting(0.0, "lora: AdamW beta1 (0: each step follows its own chunk's gradient "
                                               "alone, as the final records' adapters do).")
    ttt_lora_beta2: float = setting(0.99, "lora: AdamW beta2.")
    ttt_lora_weight_decay: float = setting(0.5, "lora: AdamW weight decay (decoupled).")
    ttt_lora_context: str = setting("stream", "lora: what a chunk's window reads: document = the document's "
                                                "own tokens only; stream = the tokens before it in the stream, "
                                                "earlier documents too, as sliding evaluation reads them.")
    ttt_lora_chunk_tokens: int = setting(32, "lora: tokens of a document scored before each adapter step.")
    ttt_lora_train_span: str = setting("chunk", "lora: what an adapter step trains on: chunk = the chunk just "
                                                "scored; window = every target of the document that the chunk's "
                                                "window holds (all scored already), so earlier chunks count again.")
    ttt_lora_batch_docs: int = setting(64, "lora: documents scored side by side, each with its own adapters.")
    ttt_lora_phases: int = setting(3, "lora: global phases: after each equal share of the first "
                                      "ttt_lora_prefix_docs documents is scored, the model trains on that share as "
                                      "--method chunks trains (ttt_lr, ttt_epochs, ...); 0 = none.")
    ttt_lora_prefix_docs: int = setting(2500, "lora: the documents the global phases cover, from the first.")
    ttt_lora_phase_span: str = setting("share", "lora: what a global phase trains on: share = the documents "
                                                "scored since the last phase; prefix = every document scored so "
                                                "far (the phases cumulative).")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)

    def to_dict(self) -> dict[str, Any]:
        return {g.name: _group_to_dict(getattr(self, g.name)) for g in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "configuration",
                  base: "RunConfig | None" = None) -> "RunConfig":
        """Parse and validate a stored configuration, as strictly as the command line."""
        cfg = cls.parse(raw, source, base)
        try:
            validate(cfg)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return cfg

    @classmethod
    def parse(cls, raw: dict[str, Any], source: str = "configuration",
              base: "RunConfig | None" = None) -> "RunConfig":
        """The settings in raw ({section: {setting: value}}) over base (default: the
        reference's), their types checked but not their values; sections and settings left
        out keep base's values."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected an object of sections")
        groups = {g.name: g for g in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(groups))
        if unknown:
            raise ConfigError(f"{source}: unknown section(s) {', '.join(unknown)}"
                              f"{_did_you_mean(unknown[0], groups, _section_of)}")
        cfg = dataclasses.replace(base) if base is not None else cls()
        for name, values in raw.items():
            setattr(cfg, name, _group_from_dict(getattr(cfg, name), values, f"{source}: [{name}]"))
        return cfg

    @classmethod
    def load(cls, path: Path, check: bool = True) -> "RunConfig":
        """A saved configuration (JSON or TOML); with check=False its values are left for
        validate() (a --config file that later flags complete or correct)."""
        cfg = load_config_file(path)
        if check:
            try:
                validate(cfg)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None
        return cfg

    def resolved(self) -> "RunConfig":
        """A copy with derived fields filled in and every setting checked (first as given,
        so that a bad value is named by the setting that holds it, not one derived from it)."""
        validate(self)
        cfg = dataclasses.replace(self, model=dataclasses.replace(self.model))
        longest = max(cfg.train.train_seq_len, cfg.train.train_seq_len_long)
        cfg.model.rope_train_seq_len = longest
        # Absolute, so that later stages find them from any working directory.
        cfg.data = dataclasses.replace(cfg.data, **{name: str(Path(getattr(cfg.data, name)).absolute())
                                                    for name in PATH_SETTINGS if getattr(cfg.data, name)})
        validate(cfg)
        return cfg


PATH_SETTINGS = ("data_path", "tokenizer_path", "tokenizer_meta_path")


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:  # json would keep the last one silently
            raise _DuplicateKey(key)
    return dict(pairs)


def load_config_file(path: Path, base: RunConfig | None = None) -> RunConfig:
    """A JSON, TOML (.toml) or YAML (.yaml, .yml) configuration file's settings over base."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable configuration file ({exc})") from None
    if path.suffix.lower() in YAML_SUFFIXES:
        raw = _parse_yaml(text, path)
    elif path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise ConfigError(f"{path}: reading TOML needs Python 3.11 or later; use JSON") from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not a valid TOML configuration ({exc})") from None
    else:
        try:
            raw = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a configuration") from None
        except _DuplicateKey as exc:
            raise ConfigError(f"{path}: the key {exc.args[0]!r} appears twice in one object; keep one") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not a valid JSON configuration ({exc}); TOML files end in .toml, "
                              "YAML files in .yaml") from None
    return RunConfig.parse(raw, source=str(path), base=base)


YAML_SUFFIXES = (".yaml", ".yml")


def _parse_yaml(text: str, path: Path) -> Any:
    """A YAML configuration, read with PyYAML's safe loader (plain data only), duplicate
    keys refused as in JSON."""
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install 'windowgpt[yaml]'); or use JSON "
                          "or TOML") from None

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for key in keys:
                if keys.count(key) > 1:
                    raise ConfigError(f"{path}: the key {key!r} appears twice in one mapping; keep one")
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader: plain data only
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a configuration") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not a valid YAML configuration ({' '.join(str(exc).split())})") from None


GROUP_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "quant": QuantConfig,
    "ttt": TTTConfig,
}


def group_fields(group: str) -> list[dataclasses.Field]:
    return list(dataclasses.fields(GROUP_TYPES[group]))


def field_type(group: str, name: str) -> Any:
    return typing.get_type_hints(GROUP_TYPES[group])[name]


def _group_to_dict(group: Any) -> dict[str, Any]:
    return {f.name: _jsonable(getattr(group, f.name)) for f in dataclasses.fields(group)}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# Settings that older windowgpts wrote and that no longer choose anything: read and dropped.
RETIRED_SETTINGS = {
    "tokenizer_meta_validate",  # the byte tables are now always checked against the tokenizer
    "window_atomic_dq",  # the window kernels' backward with dQ added atomically: slower, taken out
}


def _older_forms_upgraded(values: dict[str, Any]) -> dict[str, Any]:
    """Settings as older windowgpts wrote them, in their present form: fused_mlp and
    fold_output_scales were switches (with fused_mlp_products naming the fused MLP's
    kernels) before they could be auto; an old run's choice stays its choice."""
    values = dict(values)
    if isinstance(values.get("fused_mlp"), bool):
        products = values.pop("fused_mlp_products", "triton")
        values["fused_mlp"] = products if values["fused_mlp"] else "off"
    if isinstance(values.get("fold_output_scales"), bool):
        values["fold_output_scales"] = "on" if values["fold_output_scales"] else "off"
    return values


def _group_from_dict(base: Any, values: Any, source: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{source} must be an object")
    values = {k: v for k, v in _older_forms_upgraded(values).items() if k not in RETIRED_SETTINGS}
    hints = typing.get_type_hints(type(base))
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(unknown)}"
                          f"{_did_you_mean(unknown[0], hints, _section_of)}")
    return dataclasses.replace(base, **{k: coerce(hints[k], v, f"{source} {k}") for k, v in values.items()})


def _section_of(name: str) -> str | None:
    """The section that holds a setting (field names are unique across sections)."""
    for group, cls in GROUP_TYPES.items():
        if name in typing.get_type_hints(cls):
            return group
    return None


def _did_you_mean(name: str, known: Any, section_of: Callable[[str], str | None]) -> str:
    """'; it belongs in [optim]' for a setting put in the wrong section, '; did you mean
    matrix_lr?' for a misspelled one, else nothing."""
    home = section_of(name)
    if home is not None and name not in known:
        return f"; it belongs in [{home}]"
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def coerce(hint: Any, value: Any, what: str) -> Any:
    """Convert a JSON or command-line value to the field's type, or raise ConfigError."""
    try:
        if hint is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in {"1", "0", "true", "false", "yes", "no"}:
                    raise ValueError(value)
                return lowered in {"1", "true", "yes"}
            if isinstance(value, (bool, int)):
                return bool(value)
            raise ValueError(value)
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                raise ValueError(value)
            return value
        if typing.get_origin(hint) is tuple:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            return tuple(int(v) for v in value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{what}: {value!r} is not a valid {_type_name(hint)}") from None
    raise ConfigError(f"{what}: unsupported setting type {hint}")


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "comma-separated list of integers"
    return getattr(hint, "__name__", str(hint))


def apply_overrides(cfg: RunConfig, overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """Set the given fields ({group: {field: value}}) on a copy of cfg, each value checked
    against its bounds or choices (the combinations are validate()'s)."""
    groups = {name: dataclasses.replace(getattr(cfg, name)) for name in GROUP_TYPES}
    for group, values in overrides.items():
        for name, value in values.items():
            value = coerce(field_type(group, name), value, f"--{name.replace('_', '-')}")
            check_setting(name, value)
            setattr(groups[group], name, value)
    return RunConfig(**groups)


def grad_accum_steps_for(cfg: RunConfig, world_size: int) -> int:
    """Micro-batches per step on each rank: the setting, or 8 // world_size as the reference."""
    if cfg.train.grad_accum_steps > 0:
        return cfg.train.grad_accum_steps
    if 8 % world_size != 0:
        raise ConfigError(f"world size {world_size} does not divide 8; set --grad-accum-steps explicitly")
    return 8 // world_size


# Settings that a resumed run may change: where its data lies and how it runs, never what it computes.
RESUMABLE_SETTINGS = ("data_path", "tokenizer_path", "tokenizer_meta_path", "device", "cpu_threads", "attn_backend",
                      "compile", "compile_tuning", "compile_mix_order", "compile_multi_kernel", "fp8_mlp_kernels",
                      "micro_batches_per_pass", "sample_every", "sample_prompt", "logger", "keep_checkpoints")


# --- Presets ----------------------------------------------------------------------------

def tiny_preset() -> RunConfig:
    """A small model for a CPU that visibly learns in 60 steps, for demos and tests.

    Every feature of the full model stays on (windows with sinks, XSA, BigramHash, value
    embeddings, SmearGate, U-Net skips); the schedule is scaled to 60 steps.
    """
    return RunConfig(
        model=ModelConfig(
            num_layers=4, model_dim=64, num_heads=4, num_kv_heads=2, mlp_mult=2.0,
            rope_dims=8, xsa_last_n=2, bigram_vocab_size=256, bigram_dim=32,
            ve_dim=32, ve_layers=(2, 3), window_attn_size=32, window_attn_layers=(1, 3),
            num_sink_tokens=4, rope_train_seq_len=128,
        ),
        optim=OptimConfig(muon_momentum_warmup_steps=20, tied_embed_lr=0.05, scalar_lr=0.02, matrix_lr=0.03),
        train=TrainConfig(
            iterations=60, warmdown_iters=20, warmup_steps=2, train_batch_tokens=8 * 8 * 128, grad_accum_steps=2,
            train_seq_len=128, max_wallclock_seconds=0.0, val_loss_every=0, train_log_every=10,
            val_batch_size=8 * 8 * 128, swa_every=5, compile=False, cpu_threads=1,
        ),
        eval=EvalConfig(eval_seq_len=128, eval_stride=32, eval_batch_seqs=16),
        quant=QuantConfig(gptq_calib_samples=4, quant_passthrough_max_numel=1024),  # quantize its small matrices
        ttt=TTTConfig(ttt_chunk_tokens=2048, ttt_batch_seqs=8, ttt_freeze_blocks=1, ttt_epochs=1, ttt_lora_rank=8,
                      ttt_lora_chunk_tokens=32, ttt_lora_batch_docs=16, ttt_lora_prefix_docs=32),
    )


def frontier_preset() -> RunConfig:
    """The final leaderboard record's recipe (openai/parameter-golf PR #1855, 1.0611 bpb) as
    far as windowgpt's settings go; docs/frontier.md lists it against the record's README, with
    what is left out. Its data: `prepare --vocab-size 8192`."""
    return RunConfig(
        model=ModelConfig(
            vocab_size=8192, mlp_mult=4.0, xsa_last_n=11, qk_gain_init=5.0, bigram_vocab_size=0, ve_enabled=False,
            skip_gates=True, parallel_start_layer=8, parallel_mlp_reads_x0=False, attn_out_gate_width=12,
            attn_out_gate_scale=0.5, doc_boundary_token=1, smear_gate_width=12, recur_layers=(3, 4, 5), recur_count=3,
            rope_scaling="yarn",
        ),
        optim=OptimConfig(matrix_lr=0.026, tied_embed_lr=0.03, scalar_lr=0.02, beta2=0.99, grad_clip_norm=0.3,
                          muon_ns_coefficients="polar_express", muon_row_normalize=True, muon_momentum=0.97,
                          muon_wd=0.095, adam_wd=0.02, embed_wd=0.085),
        train=TrainConfig(warmup_steps=20, ema_decay=0.9965, warmdown_fraction=0.85, min_lr_fraction=0.1,
                          recur_start_fraction=0.35, fused_cross_entropy=True, compile_mix_order=False),
        quant=QuantConfig(use_gptq=True, gptq_calib_samples=16, gptq_reserve_seconds=4.0, quant_embed_bits=7,
                          quant_gptq_embed=True, quant_mlp_clip_sigmas=11.5, quant_attn_clip_sigmas=13.0,
                          quant_embed_clip_sigmas=14.0, quant_gates_int8=True, quant_lqer_rank=4, quant_lqer_top_k=3,
                          quant_lqer_factor_bits=4, quant_lqer_group_size=64, quant_fit_budget=True),
        ttt=TTTConfig(ttt_method="lora", ttt_lora_rank=80, ttt_lora_chunk_tokens=48, ttt_lora_beta2=0.99,
                      ttt_lora_weight_decay=0.5, ttt_lora_phases=3, ttt_lora_prefix_docs=2500),
    )


PRESETS = {"default": RunConfig, "tiny": tiny_preset, "frontier": frontier_preset}


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]()


# --- Validation -------------------------------------------------------------------------

# The one table of what each setting may be, read by validate(), by the command line's
# flags (their help, and the choices a shell completes) and so by every stage. Inclusive
# bounds of numeric settings (None: unbounded on that side; the upper bounds keep a hostile
# or mistyped stored configuration from allocating absurd amounts of memory), and the
# choices of settings that name one.
INT_MAX = 2**31 - 1
BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "vocab_size": (2, 65536), "num_layers": (1, 128), "model_dim": (2, 16384), "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024), "mlp_mult": (1e-6, 64), "tied_embed_init_std": (0, None), "logit_softcap": (1e-6, None),
    "rope_base": (1e-6, None), "rope_dims": (0, 1 << 14), "xsa_last_n": (0, 128), "bigram_vocab_size": (0, 1 << 22),
    "bigram_dim": (1, 16384), "ve_dim": (1, 16384), "window_attn_size": (0, 1 << 22), "num_sink_tokens": (0, 1 << 22),
    "rope_train_seq_len": (1, 1 << 22), "attn_out_gate_width": (0, 16384), "attn_out_gate_scale": (0, 1000),
    "doc_boundary_token": (-1, 65535), "smear_gate_width": (0, 65536), "parallel_start_layer": (0, 127),
    "recur_count": (1, 16), "recur_start_fraction": (0, 1), "qat_start_fraction": (0, 1),
    "embed_lr": (0, None), "head_lr": (0, None), "tied_embed_lr": (0, None), "matrix_lr": (0, None),
    "scalar_lr": (0, None), "muon_momentum": (0, 1), "muon_backend_steps": (1, 100),
    "muon_momentum_warmup_start": (0, 1), "muon_momentum_warmup_steps": (0, INT_MAX), "muon_wd": (0, None),
    "beta1": (0, 0.999999), "beta2": (0, 0.999999), "adam_eps": (1e-30, 1), "adam_wd": (0, None),
    "embed_wd": (-1, None),  # -1: adam_wd
    "grad_clip_norm": (0, None),
    # data_seed: 64-bit, as the seeds the reference derives from its shard paths (bench/reference_seed.py)
    "seed": (0, 2**32 - 1), "data_seed": (-1, 2**64 - 1), "iterations": (0, INT_MAX), "warmdown_iters": (0, INT_MAX),
    "warmup_steps": (0, INT_MAX), "train_batch_tokens": (1, 1 << 40), "train_seq_len": (1, 1 << 22),
    "train_seq_len_long": (0, 1 << 22), "num_gpus_long": (0, 1 << 16), "grad_accum_steps": (0, 1 << 16),
    "micro_batches_per_pass": (0, 1 << 16), "loss_chunk_rows": (0, 1 << 30),
    "max_wallclock_seconds": (0, None), "val_loss_every": (0, INT_MAX), "train_log_every": (0, INT_MAX),
    "val_batch_size": (1, 1 << 40), "ema_decay": (0, 0.999999999), "warmdown_max_fraction": (1e-9, 1),
    "warmdown_fraction": (0, 1), "min_lr_fraction": (0, 1),
    "swa_every": (1, INT_MAX), "checkpoint_every": (0, INT_MAX), "sample_every": (0, INT_MAX), "cpu_threads": (0, 4096),
    "keep_checkpoints": (0, 1 << 20),
    "eval_seq_len": (1, 1 << 22), "eval_stride": (0, 1 << 22), "eval_batch_seqs": (0, 1 << 20),
    "quant_clip_range": (1, 127), "quant_passthrough_max_numel": (0, 1 << 40), "gptq_calib_samples": (0, 1 << 20),
    "gptq_block_size": (1, 1 << 16), "gptq_percdamp": (0, 1), "gptq_reserve_seconds": (0, None),
    "quant_embed_bits": (2, 8), "quant_mlp_clip_sigmas": (0, 1000), "quant_attn_clip_sigmas": (0, 1000),
    "quant_embed_clip_sigmas": (0, 1000), "quant_lqer_rank": (0, 256), "quant_lqer_top_k": (1, 1 << 16),
    "quant_lqer_factor_bits": (2, 8), "quant_lqer_group_size": (1, 1 << 16),
    "ttt_lr": (0, None), "ttt_epochs": (0, 1000), "ttt_chunk_tokens": (1, 1 << 30), "ttt_seq_len": (0, 1 << 22),
    "ttt_freeze_blocks": (0, 128),
    "ttt_momentum": (0, 1), "ttt_batch_seqs": (1, 1 << 20), "ttt_grad_clip": (0, None),
    "ttt_lora_rank": (1, 4096), "ttt_lora_lr": (0, 10), "ttt_lora_beta1": (0, 0.999999),
    "ttt_lora_beta2": (0, 0.999999), "ttt_lora_weight_decay": (0, 1000), "ttt_lora_chunk_tokens": (1, 1 << 22),
    "ttt_lora_batch_docs": (1, 1 << 16), "ttt_lora_phases": (0, 1 << 10), "ttt_lora_prefix_docs": (0, 1 << 30),
}
# The numbers commands take besides the settings (each checked by check_setting as well).
BOUNDS.update({
    "val_fraction": (0, 1), "shard_tokens": (1, INT_MAX), "workers": (1, 4096), "tokenizer_sample_bytes": (1, 1 << 40),
    "stop_at_step": (1, INT_MAX), "max_new_tokens": (1, 1 << 20), "temperature": (0, 1000), "top_k": (0, 65536),
    "num_samples": (1, 1 << 16), "budget": (1, 1 << 40), "train_budget": (1e-3, None), "eval_budget": (1e-3, None),
    "artifact_budget": (1, 1 << 40), "gpus": (1, 1 << 16),
})
EXCLUSIVE = {"val_fraction"}  # bounds that the value may not equal
CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "attn_backend": ("auto", "fa3", "fa4", "flex", "triton", "triton_fa4", "sdpa"),
    "logger": ("none", "tensorboard", "wandb"),
    "muon_ns_coefficients": ("reference", "polar_express"),
    "ttt_method": ("chunks", "lora"),
    "rope_scaling": ("ntk", "yarn"),
    "ttt_lora_context": ("document", "stream"),
    "ttt_lora_train_span": ("chunk", "window"),
    "ttt_lora_phase_span": ("share", "prefix"),
    "compile_tuning": ("default", "gemm", "full"),
    "fused_mlp": ("auto", "off", "triton", "quack"),
    "keep_mlp_activation": ("auto", "on", "off"),
    "copy_kv_heads": ("auto", "on", "off"),
    "stack_qkv": ("auto", "on", "off", "qk"),
    "fold_output_scales": ("auto", "on", "off"),
    "fused_head_prep": ("auto", "on", "off", "apart"),
    "fused_xsa": ("auto", "on", "off"),
}
LORA_TARGETS = ("q", "k", "v", "o", "up", "down", "head")  # ttt_lora_targets' names
MAX_PARAMETERS = 4_000_000_000  # about 150 times the reference model


def bounds_text(name: str) -> str:
    """What a setting may be, in words ("in 1..128", "at least 0", "one of auto, cpu, cuda"); "" when free."""
    if name in CHOICES:
        return "one of " + ", ".join(CHOICES[name])
    lo, hi = BOUNDS.get(name, (None, None))
    if lo is None and hi is None:
        return ""
    if name in EXCLUSIVE:
        return f"between {lo} and {hi}, both excluded"
    return f"at least {lo}" if hi is None else f"at most {hi}" if lo is None else f"in {lo}..{hi}"


def check_settings(**values: Any) -> None:
    """check_setting for each given value (None: not given)."""
    for name, value in values.items():
        if value is not None:
            check_setting(name, value)


def check_setting(name: str, value: Any) -> None:
    """SettingError unless value is finite and within the setting's bounds or choices."""
    if name in CHOICES and value not in CHOICES[name]:
        raise SettingError(name, f"{name}={value!r} must be {bounds_text(name)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(name, f"{name}={value} must be a finite number")
    lo, hi = BOUNDS.get(name, (None, None))
    outside = (lo is not None and value < lo) or (hi is not None and value > hi)
    if outside or (name in EXCLUSIVE and value in (lo, hi)):
        raise SettingError(name, f"{name}={value} must be {bounds_text(name)}")


def _check_settings(cfg: RunConfig) -> None:
    """Every setting within its bounds or choices (BOUNDS, CHOICES)."""
    for group in GROUP_TYPES:
        section = getattr(cfg, group)
        for f in dataclasses.fields(section):
            check_setting(f.name, getattr(section, f.name))


def parameter_estimate(m: ModelConfig) -> int:
    """Roughly the model's parameter count, from its shape alone (nothing allocated)."""
    per_layer = 2 * m.model_dim * m.model_dim + 2 * m.model_dim * m.kv_dim + 2 * m.model_dim * m.mlp_dim
    return m.num_layers * per_layer + m.vocab_size * m.model_dim + m.bigram_vocab_size * m.bigram_dim \
        + m.vocab_size * m.ve_dim


def lora_targets(text: str) -> tuple[str, ...]:
    """ttt_lora_targets as names ("q,k , head" -> ("q", "k", "head"))."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def lora_targets_problem(text: str) -> str | None:
    """What is wrong with a ttt_lora_targets value, or None."""
    names = lora_targets(text)
    unknown = [t for t in names if t not in LORA_TARGETS]
    if unknown:
        return f"{unknown[0]!r} is none of {', '.join(LORA_TARGETS)}"
    if not names:
        return "name at least one matrix"
    if len(set(names)) < len(names):
        return "names a matrix twice"
    return None


def recur_problem(m: ModelConfig) -> str | None:
    """What is wrong with the depth recurrence's layers, or None."""
    layers = list(m.recur_layers)
    if not layers:
        return "give the layers to loop" if m.recur_count > 1 else None
    if layers != list(range(layers[0], layers[0] + len(layers))):
        return "the layers must be consecutive and ascending"
    if layers[0] < 0 or layers[-1] > m.num_layers - 2:
        return f"the layers must lie in 0..{m.num_layers - 2} (the last layer runs once)"
    if m.parallel_start_layer and layers[-1] >= m.parallel_start_layer:
        return f"the layers must lie before parallel_start_layer={m.parallel_start_layer}"
    return None


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError naming the first invalid setting or combination."""
    _check_settings(cfg)
    m, t = cfg.model, cfg.train
    loop_problem, targets_problem = recur_problem(m), lora_targets_problem(cfg.ttt.ttt_lora_targets)
    checks: list[tuple[bool, str | None, str]] = [  # (holds, the setting it is about, message)
        (parameter_estimate(m) <= MAX_PARAMETERS, None, f"the model's shape gives about {parameter_estimate(m):,} "
                                                        f"parameters, more than {MAX_PARAMETERS:,}"),
        (t.grad_accum_steps == 0 or t.train_batch_tokens % (t.grad_accum_steps * t.train_seq_len) == 0,
         "train_batch_tokens", f"train_batch_tokens={t.train_batch_tokens} must be a multiple of grad_accum_steps x "
         f"train_seq_len = {max(t.grad_accum_steps, 1) * t.train_seq_len} (the loader takes whole sequences)"),
        (cfg.eval.eval_stride <= cfg.eval.eval_seq_len, "eval_stride",
         f"eval_stride={cfg.eval.eval_stride} must be at most eval_seq_len={cfg.eval.eval_seq_len} (0 or "
         f"{cfg.eval.eval_seq_len}: consecutive sequences)"),
        (m.model_dim % m.num_heads == 0, "num_heads",
         f"num_heads={m.num_heads} does not divide model_dim={m.model_dim}"),
        (m.num_heads % m.num_kv_heads == 0, "num_kv_heads",
         f"num_kv_heads={m.num_kv_heads} does not divide num_heads={m.num_heads}"),
        (m.head_dim % 2 == 0, "model_dim", f"head_dim={m.head_dim} (model_dim/num_heads) must be even for rotary "
                                           "embeddings"),
        (m.rope_dims <= m.head_dim and m.rope_dims % 2 == 0, "rope_dims",
         f"rope_dims={m.rope_dims} must be even and at most head_dim={m.head_dim}"),
        (m.rope_dims != 2, "rope_dims", "rope_dims=2 leaves nothing to rescale beyond the training length; use 0 or "
                                        "at least 4"),
        (m.mlp_dim > 0, "mlp_mult", f"mlp_mult={m.mlp_mult} gives an empty MLP"),
        (m.xsa_last_n <= m.num_layers, "xsa_last_n", f"xsa_last_n={m.xsa_last_n} must be in 0..num_layers="
                                                     f"{m.num_layers}"),
        (m.parallel_start_layer == 0 or m.num_layers // 2 <= m.parallel_start_layer < m.num_layers,
         "parallel_start_layer", f"parallel_start_layer={m.parallel_start_layer} must be 0 or a decoder layer, "
         f"{m.num_layers // 2}..{m.num_layers - 1}"),
        (loop_problem is None, "recur_layers", f"recur_layers={','.join(map(str, m.recur_layers))}: {loop_problem}"),
        (m.smear_gate_width <= m.model_dim, "smear_gate_width",
         f"smear_gate_width={m.smear_gate_width} must be at most model_dim={m.model_dim}"),
        (m.attn_out_gate_width <= m.model_dim, "attn_out_gate_width",
         f"attn_out_gate_width={m.attn_out_gate_width} must be at most model_dim={m.model_dim}"),
        (m.doc_boundary_token < m.vocab_size, "doc_boundary_token",
         f"doc_boundary_token={m.doc_boundary_token} is no token of a vocabulary of {m.vocab_size}"),
        (m.bigram_vocab_size != 1, "bigram_vocab_size", "bigram_vocab_size=1 must be 0 (off) or at least 2"),
        (m.num_sink_tokens == 0 or m.window_attn_size > 0, "num_sink_tokens",
         f"num_sink_tokens={m.num_sink_tokens} needs window_attn_size > 0"),
        (t.train_seq_len_long == 0 or t.num_gpus_long > 0, "train_seq_len_long",
         f"train_seq_len_long={t.train_seq_len_long} needs num_gpus_long > 0"),
        (not cfg.quant.use_gptq or cfg.quant.gptq_calib_samples >= 1, "gptq_calib_samples",
         f"gptq_calib_samples={cfg.quant.gptq_calib_samples} must be at least 1 with GPTQ"),
        (not (cfg.quant.use_gptq and 0 < t.max_wallclock_seconds <= cfg.quant.gptq_reserve_seconds),
         "gptq_reserve_seconds", f"gptq_reserve_seconds={cfg.quant.gptq_reserve_seconds} leaves no training time "
         f"within max_wallclock_seconds={t.max_wallclock_seconds}"),
        (not cfg.quant.quant_gptq_embed or cfg.quant.use_gptq, "quant_gptq_embed",
         "quant_gptq_embed needs use_gptq (--gptq)"),
        (not cfg.quant.quant_gptq_embed or m.tie_embeddings, "quant_gptq_embed",
         "quant_gptq_embed needs tied embeddings (its Hessian is the output layer's input)"),
        (not ((t.fp8_mlp or t.fp8_attention) and t.fused_mlp in ("triton", "quack")), "fused_mlp",
         f"fused_mlp={t.fused_mlp} runs the MLP's products in its own kernels: it cannot be combined with fp8_mlp "
         "or fp8_attention"),
        (t.fused_mlp != "quack" or 0 <= m.negative_slope <= 1, "fused_mlp",
         f"fused_mlp=quack takes negative_slope in 0..1 (it is {m.negative_slope})"),
        (cfg.optim.embed_wd == -1 or cfg.optim.embed_wd >= 0, "embed_wd",
         f"embed_wd={cfg.optim.embed_wd} must be -1 (adam_wd) or at least 0"),
        (targets_problem is None, "ttt_lora_targets",
         f"ttt_lora_targets={cfg.ttt.ttt_lora_targets!r}: {targets_problem}"),
    ]
    for ok, name, message in checks:
        if not ok:
            raise ConfigError(message) if name is None else SettingError(name, message)
    for name, layers in (("ve_layers", m.ve_layers if m.ve_enabled else ()),
                         ("window_attn_layers", m.window_attn_layers if m.window_attn_size else ())):
        bad = [i for i in layers if not 0 <= i < m.num_layers]
        if bad:
            raise SettingError(name, f"{name} names layer {bad[0]}, but the model has layers 0..{m.num_layers - 1}")
