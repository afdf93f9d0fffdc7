"""LoRA fine-tuning with the Hugging Face ``Trainer``, peft and storm, the base model's big
weights streamed from host memory (docs/trainers.md says why each step is done this way).

    python examples/trainer_lora.py                               # tiny: seconds on a CPU
    python examples/trainer_lora.py --hidden 2048 --layers 16 --seq 2048 --budget 0.5

A Llama with random weights (nothing is downloaded) learns random tokens: the example shows
the wiring, not a fine-tune worth keeping. It runs on CUDA when present (bf16 autocast,
Inductor), else on the CPU (storm's graphs run without Inductor's code generation, which would
take longer than the training). Needs ``pip install transformers peft``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from storm_compile import storm
from storm_compile.weights.streaming import stream_parameters

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection of a Llama block, as LoRA recipes commonly adapt them."""
DEFAULT_RESIDENT_BYTES = 8 * 1024
"""Small enough that the tiny default model streams its matrices (16 KiB and up); a real
model's matrices (tens of MiB) stream at storm's own default, 1 MiB, too."""
VOCAB = 256


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--budget", default=None,
                        help="storm's memory_budget (a fraction such as 0.5, or bytes)")
    parser.add_argument("--resident-bytes", type=int, default=DEFAULT_RESIDENT_BYTES,
                        help="parameters smaller than this stay on the device")
    parser.add_argument("--output-dir", type=Path, default=Path("trainer_lora_out"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config)

    # 1. Stream the base model's big weights before anything else sees the model. The Trainer
    #    moves the model to its device; streamed weights stay in host memory through that move.
    streamed = stream_parameters(model, device, resident_bytes=args.resident_bytes)
    # 2. Adapters: peft puts them beside the base layer's (fetched) weight, on the device.
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS,
                                             lora_dropout=0.0))
    # 3. Compile in place with storm's options: TrainingArguments(torch_compile_backend=...)
    #    only takes the backends accelerate lists, and has no field for storm's options.
    options = {} if cuda else {"inner": "eager"}
    if args.budget is not None:
        options["memory_budget"] = args.budget
    model.compile(backend=storm(**options))

    rows = torch.randint(0, VOCAB, (4 * args.steps, args.seq))
    data = [{"input_ids": row, "labels": row} for row in rows]
    training = TrainingArguments(
        output_dir=str(args.output_dir), max_steps=args.steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=not cuda, bf16=cuda)
    Trainer(model=model, args=training, train_dataset=data).train()

    model.save_pretrained(str(args.output_dir))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{len(streamed.names)} base parameters streamed from host memory "
          f"({streamed.host_bytes / 2**20:.1f} MiB), {adapters} adapter weights trained on "
          f"{device}; adapters saved to {args.output_dir}")


if __name__ == "__main__":
    main()
