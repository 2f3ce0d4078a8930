"""GGUFs of an image benchmark model (benchmarks/image_serve.py) for llama-server's mtmd path:
the language model and the vision projector (--mmproj), written by llama.cpp's own
convert_hf_to_gguf.py from the Hugging Face directory.

The bench models' tokenizer.json files come from zllm's GGUF loader, whose pre-tokenizer
llama.cpp's converter does not recognise (it hashes a tokenization to name one). So the
text GGUF's tokenizer is copied from the GGUF that tokenizer came from (--tokenizer-gguf:
SmolLM2's for qwen2_5_vl, Gemma 3 270M's for gemma3), with the model's added tokens (the
image tokens) after it and unused rows up to the embedding's row count.

    python benchmarks/image_gguf.py MODEL_DIR --llama-cpp SRC --tokenizer-gguf TOK.gguf \
        --outdir DIR [--outtype f32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ID_KEYS = tuple(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "unknown", "padding"))
FLAG_KEYS = tuple(
    f"tokenizer.ggml.{k}" for k in ("add_bos_token", "add_eos_token", "add_space_prefix")
)
CONTROL, UNUSED = 3, 5


def copy_vocab(writer, donor_path: str, model_dir: Path, rows: int) -> None:
    """The donor GGUF's tokenizer, the model's added tokens past it, unused rows to `rows`."""
    import gguf

    fields = gguf.GGUFReader(donor_path).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    scores = fields.get("tokenizer.ggml.scores")
    scores = list(scores.contents()) if scores else None
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    for token in sorted(added, key=lambda t: t["id"]):
        if token["id"] == len(tokens):
            tokens.append(token["content"])
            types.append(CONTROL)
    while len(tokens) < rows:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores + [0.0] * (len(tokens) - len(scores)))
    if "tokenizer.ggml.merges" in fields:
        writer.add_token_merges(list(fields["tokenizer.ggml.merges"].contents()))
    for key in ID_KEYS + FLAG_KEYS:  # copied as they are
        if key in fields:
            value = fields[key].contents()
            if key in ID_KEYS:
                writer.add_uint32(key, int(value))
            else:
                writer.add_bool(key, bool(value))
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    writer.add_chat_template(template)


def convert(model_dir: Path, llama_cpp: Path, donor: str, out: Path, outtype: str, mmproj: bool):
    """Run llama.cpp's converter in this process with its vocabulary step replaced."""
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import base

    config = json.loads((model_dir / "config.json").read_text())
    rows = int(config.get("text_config", config)["vocab_size"])

    def set_vocab(self) -> None:
        copy_vocab(self.gguf_writer, donor, model_dir, rows)

    base.TextModel._set_vocab_gpt2 = set_vocab
    if "mm_tokens_per_image" in config:  # Gemma 3: the pooling comes from the token count
        from conversion import gemma

        parameters = gemma.Gemma3VisionModel.set_gguf_parameters

        def set_gguf_parameters(self) -> None:
            self.preprocessor_config.setdefault("image_seq_length", config["mm_tokens_per_image"])
            parameters(self)

        gemma.Gemma3VisionModel.set_gguf_parameters = set_gguf_parameters
        # transformers 5 saves the SigLIP tower without its "vision_model." level
        tensors = gemma.Gemma3VisionModel.filter_tensors.__func__

        def filter_tensors(cls, item):
            name, gen = item
            if name.startswith("vision_tower.") and ".vision_model." not in name:
                name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
            return tensors(cls, (name, gen))

        gemma.Gemma3VisionModel.filter_tensors = classmethod(filter_tensors)
    base.TextModel._set_vocab_sentencepiece = set_vocab
    sys.argv = [
        "convert_hf_to_gguf.py",
        str(model_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(out),
    ]
    if mmproj:
        sys.argv.append("--mmproj")
    convert_hf_to_gguf.main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    parser.add_argument("--tokenizer-gguf", required=True)
    parser.add_argument("--outdir", required=True)
    parser.add_argument("--outtype", default="f32")
    parser.add_argument("--part", choices=["text", "mmproj"], default=None)
    args = parser.parse_args()
    model_dir = Path(args.model_dir)
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    name = model_dir.name
    if args.part is None:  # each part in its own process: the converter keeps global state
        for part in ("text", "mmproj"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--part", part], check=True)
        return
    out = outdir / (
        f"{name}-{args.outtype}.gguf"
        if args.part == "text"
        else f"mmproj-{name}-{args.outtype}.gguf"
    )
    convert(
        model_dir,
        Path(args.llama_cpp),
        args.tokenizer_gguf,
        out,
        args.outtype,
        args.part == "mmproj",
    )


if __name__ == "__main__":
    main()
