"""The README runs as printed: every Python snippet in it is extracted and executed on the CPU, with its
placeholder paths pointing at a tiny saved model (and its tokenizer) and at the bundled corpus."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section(title: str) -> str:
    """The text of the README's `## title` section, up to the next `## ` heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else None]


def python_snippets(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def labelled_snippets(title: str) -> dict[str, str]:
    """The Python snippets of a section, each under the bold label of the paragraph before it
    (`**TRL** (...)` labels `trl`)."""
    label_then_code = r"\n\*\*([^*\n]+)\*\*[^\n]*\n(?:(?!```)[^\n]+\n)*```python\n(.*?)```"
    found = re.findall(label_then_code, section(title), flags=re.S)
    return {label.split()[-1].lower(): code for label, code in found}


QUICK_START = labelled_snippets("Quick start")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved with the demo tokenizer: what `path/to/llama` stands for."""
    from transformers import AutoModelForCausalLM

    from hf_slideformer.demo import tiny_config, train_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = train_tokenizer()
    AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tok), max_position_embeddings=512)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_quick_start_has_the_documented_snippets():
    assert list(QUICK_START) == ["notebook", "slidetrainer", "lora", "trl"]
    assert "for batch in loader:" in QUICK_START["notebook"] and "SlideTrainer" in QUICK_START["slidetrainer"]
    assert "get_peft_model" in QUICK_START["lora"] and "merge_and_unload" in QUICK_START["lora"]
    assert "SFTTrainer(model=hs.SlideModel.from_pretrained(" in QUICK_START["trl"]


def test_every_python_snippet_of_the_readme_is_run():
    """A snippet added anywhere in the README (or one whose label the pattern misses) fails here
    instead of going unrun."""
    assert sorted(python_snippets(README.read_text(encoding="utf-8"))) == sorted(QUICK_START.values())


@pytest.mark.parametrize("snippet", list(QUICK_START.values()), ids=list(QUICK_START))
def test_quick_start_snippet_runs_as_printed(snippet, tiny_llama_dir, tmp_path):
    from hf_slideformer.demo import corpus_path

    placeholders = {"path/to/llama": str(tiny_llama_dir), "path/to/train.txt": corpus_path()}
    code = snippet
    for placeholder, path in placeholders.items():
        code = code.replace(f'"{placeholder}"', repr(path))
    assert not re.search(r'"path/to/', code), "a placeholder the test does not know"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "out").rglob("model.safetensors"))     # a saved model, or the Trainer's checkpoint
