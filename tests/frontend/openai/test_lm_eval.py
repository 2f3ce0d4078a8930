"""lm-eval (PyPI `lm-eval`) against a real `zllm serve`, on a task file written here (no
hub): `local-completions` with generate_until and loglikelihood (multiple choice), and
`local-chat-completions` with generate_until; every item's answer equals lm-eval's
in-process `hf` model on the same weights (greedy text exactly, log-likelihoods to 1e-4).
Items that differ only by a near tie would be listed; the tiny model's wide init has none."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tiny_models import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

DOCS = [
    {
        "question": "The quick brown",
        "answer": " fox",
        "choices": [" fox", " dog", " cat"],
        "label": 0,
    },
    {
        "question": "Paged attention stores",
        "answer": " keys",
        "choices": [" keys", " blocks"],
        "label": 1,
    },
    {"question": "1234567890 +", "answer": " 42", "choices": [" 42", " 1", " 7"], "label": 2},
    {
        "question": "Continuous batching lets",
        "answer": " requests",
        "choices": [" requests", " tokens"],
        "label": 0,
    },
    {
        "question": "def add(a, b):",
        "answer": " return",
        "choices": [" return", " pass"],
        "label": 0,
    },
]


def _lm_eval():
    if os.environ.get("CI"):  # CI installs the test extra: missing is a failure there
        import lm_eval
    else:
        lm_eval = pytest.importorskip("lm_eval")
    return lm_eval


def write_tasks(directory: Path) -> None:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\ndoc_to_text: "{{question}}"\n'
    )
    (directory / "gen.yaml").write_text(
        "task: zllm_gen\n" + common + "output_type: generate_until\n"
        'doc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (directory / "mc.yaml").write_text(
        "task: zllm_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n"
    )


def evaluate(lm_eval, directory: Path, model: str, args: str, tasks: list[str], chat: bool):
    from lm_eval.tasks import TaskManager

    # Only this directory's tasks: indexing lm-eval's own thousands of task files took most
    # of this test's time (each call, ~9 s on the 2-core machine).
    tasks_here = TaskManager(include_path=str(directory), include_defaults=False)
    result = lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=tasks,
        task_manager=tasks_here,
        log_samples=True,
        batch_size=1,
        device="cpu",
        apply_chat_template=chat,
    )
    return {t: [s["filtered_resps"] for s in result["samples"][t]] for t in tasks}


def test_lm_eval_scores_equal_the_hf_model(engine_pool, tmp_path) -> None:
    lm_eval = _lm_eval()
    model_dir = write_tiny_model(tmp_path / "model")
    write_tasks(tmp_path)
    with engine_pool.serve(
        str(model_dir), tmp_path / "server.log", "--served-model-name", "tiny"
    ) as server:
        api = f"model=tiny,num_concurrent=1,max_retries=1,base_url={server.url}/v1"
        tokenizer = f",tokenizer_backend=huggingface,tokenizer={model_dir}"
        ours = evaluate(
            lm_eval,
            tmp_path,
            "local-completions",
            api + "/completions" + tokenizer,
            ["zllm_gen", "zllm_mc"],
            chat=False,
        )
        ours_chat = evaluate(
            lm_eval,
            tmp_path,
            "local-chat-completions",
            api + "/chat/completions",
            ["zllm_gen"],
            chat=True,
        )
    hf_args = f"pretrained={model_dir},dtype=float32"
    theirs = evaluate(lm_eval, tmp_path, "hf", hf_args, ["zllm_gen", "zllm_mc"], chat=False)
    theirs_chat = evaluate(lm_eval, tmp_path, "hf", hf_args, ["zllm_gen"], chat=True)

    differing = [
        (label, i, a, b)
        for label, mine, ref in (
            ("completions", ours["zllm_gen"], theirs["zllm_gen"]),
            ("chat", ours_chat["zllm_gen"], theirs_chat["zllm_gen"]),
        )
        for i, (a, b) in enumerate(zip(mine, ref, strict=True))
        if a != b
    ]
    print("near-tie items:", differing)
    assert differing == []
    for i, (mine, ref) in enumerate(zip(ours["zllm_mc"], theirs["zllm_mc"], strict=True)):
        mine_ll = [ll for ll, _ in mine]
        ref_ll = [ll for ll, _ in ref]
        assert mine_ll == pytest.approx(ref_ll, abs=1e-4), i
        assert mine_ll.index(max(mine_ll)) == ref_ll.index(max(ref_ll)), i
