#!/usr/bin/env python3
"""Fine-tuning from Hugging Face, end to end through the `flotilla` binary.

    python scripts/hf_finetune_check.py FLOTILLA_BIN WORKDIR

For a GPT-2-layout model (tied head, gelu_new, f32 weights in one file) and a
Llama-layout model (GQA, untied head, rope_theta 50000, bf16 weights in
shards with model.safetensors.index.json), each made by Transformers (random
init, save_pretrained) with a tokenizer trained here by the `tokenizers`
package (BPE, wrapped in PreTrainedTokenizerFast, save_pretrained):

1. `flotilla data prepare --tokenizer DIR/tokenizer.json` tokenizes a corpus
   into one shard; with `--shuffle-window 1` the loader's first batch is the
   shard's first rows, which this script reads back.
2. `flotilla train --init-hf DIR` trains 20 steps; its step-1 loss (the
   first batch under the loaded weights) must equal Transformers' loss on the
   same tokens within 1e-4 relative, and the loss must go down. The same first
   loss is required under other layouts (GPT-2: 2 ranks with ZeRO-3; Llama:
   2 ranks with --tp 2).
3. The export (`--export-hf`, bf16 for the Llama) reloads with
   AutoModelForCausalLM and AutoTokenizer, and Transformers' greedy
   continuation of a prompt equals `flotilla generate --hf EXPORT
   --temperature 0 --ids` token for token; `flotilla generate --hf DIR` on the
   original directory matches Transformers too.
4. Models trained from scratch with the built-in byte and gpt2 tokenizers
   export them as tokenizer.json: AutoTokenizer encodes the prompt as Flotilla
   does (byte for byte for the byte tokenizer) and Transformers continues it
   as `flotilla generate --model` does.

Exit status 0 when every check holds, 1 otherwise (the failure on stderr).
"""
import json
import os
import random
import subprocess
import sys

import torch

TOL = 1e-4
SEQ = 32
STEPS = 20
PROMPT = "the quick model reads"
NEW_TOKENS = 12
WORDS = ("the quick brown fox jumps over a lazy dog while small models read long "
         "stories about rivers mountains and cities near the sea every day").split()


def fail(msg):
    print(f"hf_finetune_check: {msg}", file=sys.stderr)
    sys.exit(1)


def run(args, **kw):
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)
    if p.returncode != 0:
        fail(f"{' '.join(args)} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p.stdout


def corpus(path):
    rng = random.Random(7)
    with open(path, "w") as f:
        for _ in range(200):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) + "\n\n")


def tokenizer(text_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([text_path], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")


def make_model(kind, vocab, out, tok):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(1 if kind == "gpt2" else 2)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        m = AutoModelForCausalLM.from_config(cfg)
        m.save_pretrained(out)
    else:
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, rope_theta=50000.0,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        m = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        m.save_pretrained(out, max_shard_size="40KB")
        if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
            fail(f"{out}: expected a sharded save")
    tok.save_pretrained(out)


def load(dir_):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(dir_, dtype=torch.float32, attn_implementation="eager")
    m.eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def first_rows(ds, rows):
    with open(os.path.join(ds, "manifest.json")) as f:
        man = json.load(f)
    if len(man["shards"]) != 1:
        fail(f"{ds}: expected one shard, got {len(man['shards'])}")
    width = man["token_bytes"]
    shard = man["shards"][0]
    name = shard.get("file") or shard.get("path") or shard.get("name")
    with open(os.path.join(ds, name), "rb") as f:
        f.seek(64)
        raw = f.read(width * (rows * SEQ + 1))
    ids = [int.from_bytes(raw[i:i + width], "little") for i in range(0, len(raw), width)]
    return torch.tensor([ids[r * SEQ:r * SEQ + SEQ + 1] for r in range(rows)], dtype=torch.long)


def hf_loss(model, rows):
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1], use_cache=False).logits.to(torch.float64)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()


def losses(metrics):
    out = []
    with open(metrics) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "step":
                out.append(r["loss"])
    return out


def train(bin_, src, ds, work, name, extra, batch, steps=STEPS):
    metrics = os.path.join(work, f"{name}.jsonl")
    args = [bin_, "train", "--init-hf", src, "--dataset", ds, "--shuffle-window", "1",
            "--seq-len", str(SEQ), "--steps", str(steps), "--batch", str(batch), "--lr", "3e-3",
            "--threads", "1", "--peak-gflops", "10", "--no-plan", "--no-progress",
            "--metrics", metrics] + extra
    out = run(args)
    if "# initialised from the Hugging Face" not in out:
        fail(f"{name}: no initialisation line in\n{out}")
    return losses(metrics)


def greedy_check(bin_, dir_, want_ids, what, source=None):
    """Transformers' greedy continuation of PROMPT from dir_ (model and AutoTokenizer, whose
    prompt ids must be want_ids) against `flotilla generate` on source (default: --hf dir_)."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(dir_)
    ids = hf_tok(PROMPT, add_special_tokens=False)["input_ids"]
    if want_ids is not None and ids != want_ids:
        fail(f"{what}: AutoTokenizer encodes the prompt as {ids}, expected {want_ids}")
    model = load(dir_)
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS)[0].tolist()
    out = run([bin_, "generate"] + (source or ["--hf", dir_]) + [
        "--prompt", PROMPT, "--temperature", "0", "--tokens", str(NEW_TOKENS), "--ids"])
    ours = [int(x) for x in out.split()]
    if ours != hf:
        fail(f"{what}: greedy continuations differ\n flotilla     {ours}\n transformers {hf}")
    print(f"{what}: greedy continuation of {len(ids)} prompt tokens by {NEW_TOKENS} equal: "
          f"{hf_tok.decode(hf[len(ids):])!r}")


def check(bin_, work, kind, tok, text):
    src = os.path.join(work, f"{kind}-hf")
    make_model(kind, len(tok), src, tok)
    ds = os.path.join(work, f"{kind}-ds")
    run([bin_, "data", "prepare", text, "-o", ds, "--tokenizer",
         os.path.join(src, "tokenizer.json"), "--no-progress"])
    batch = 2
    ref = hf_loss(load(src), first_rows(ds, batch))
    export = os.path.join(work, f"{kind}-export")
    saved = os.path.join(work, f"{kind}-saved")
    extra = ["--nproc", "1", "--export-hf", export, "--save", saved]
    if kind == "llama":
        extra += ["--export-dtype", "bf16"]
    ls = train(bin_, src, ds, work, kind, extra, batch)
    rel = abs(ls[0] - ref) / abs(ref)
    print(f"{kind}: first-batch loss flotilla {ls[0]:.6f} transformers {ref:.6f} rel {rel:.2e}; "
          f"step {len(ls)} loss {ls[-1]:.4f}")
    if rel > TOL:
        fail(f"{kind}: first-batch loss differs by {rel:.2e} relative (> {TOL})")
    if len(ls) != STEPS or not ls[-1] < ls[0]:
        fail(f"{kind}: expected {STEPS} steps with a falling loss, got {ls}")
    if kind == "gpt2":
        layout, extra = "2 ranks ZeRO-3", ["--nproc", "2", "--zero", "3"]
        lb = 1
    else:
        layout, extra = "2 ranks --tp 2", ["--nproc", "2", "--tp", "2"]
        lb = batch
    other = train(bin_, src, ds, work, f"{kind}-layout", extra, lb, steps=2)
    rel = abs(other[0] - ref) / abs(ref)
    print(f"{kind}: first-batch loss under {layout} {other[0]:.6f} rel {rel:.2e}")
    if rel > TOL:
        fail(f"{kind}: under {layout} the first-batch loss differs by {rel:.2e} relative")
    with open(os.path.join(export, "config.json")) as f:
        dtype = json.load(f).get("torch_dtype")
    want = "bfloat16" if kind == "llama" else "float32"
    if dtype != want:
        fail(f"{kind}: export's torch_dtype is {dtype}, expected {want}")
    want = tok(PROMPT, add_special_tokens=False)["input_ids"]
    greedy_check(bin_, export, want, f"{kind} export ({dtype})")
    greedy_check(bin_, src, want, f"{kind} original")
    if kind == "gpt2":
        # The f32 export and the --save of the same run continue alike (its tokenizer.json).
        greedy_check(bin_, export, want, f"{kind} --save", source=["--model", saved])


def builtin_export(bin_, work, kind):
    """A model trained from scratch with a built-in tokenizer (byte, gpt2): its export carries
    the tokenizer as tokenizer.json, and Transformers continues as `flotilla generate --model`."""
    export, saved = os.path.join(work, f"{kind}-tok-export"), os.path.join(work, f"{kind}-tok-saved")
    text = os.path.join(work, "corpus.txt")
    run([bin_, "train", "--nproc", "1", "--config", "tiny", "--layers", "1", "--d-model", "32",
         "--heads", "2", "--seq-len", "32", "--batch", "2", "--steps", "5", "--data", "text",
         "--text", text, "--tokenizer", kind, "--threads", "1", "--peak-gflops", "10",
         "--no-plan", "--no-progress", "--export-hf", export, "--save", saved])
    want = list(PROMPT.encode()) if kind == "byte" else None
    greedy_check(bin_, export, want, f"{kind}-tokenizer export", source=["--model", saved])


def main():
    if len(sys.argv) != 3:
        fail("usage: hf_finetune_check.py FLOTILLA_BIN WORKDIR")
    bin_, work = sys.argv[1], sys.argv[2]
    import transformers
    transformers.utils.logging.disable_progress_bar()
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(1)
    text = os.path.join(work, "corpus.txt")
    corpus(text)
    tok = tokenizer(text)
    for kind in ("gpt2", "llama"):
        check(bin_, work, kind, tok, text)
    for kind in ("byte", "gpt2"):
        builtin_export(bin_, work, kind)
    print("hf_finetune_check: ok")


if __name__ == "__main__":
    main()
