"""Building the CPU kernels (cpu_kernels.py) from their C++ files in the package (kernels/).

What a user relies on: a broken kernel source is reported at the file and line to open, a new
source version never loads a library built from an older one, and an installed package carries
every source file it compiles.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import logging
import shutil
import tomllib
from pathlib import Path

import pytest

from llmq.worker.engine.model.cpu_kernels import (
    KERNEL_DIR,
    build_key,
    build_library,
    kernel_sources,
)
from tests.fixtures.redis_servers import in_ci

ROOT = Path(__file__).resolve().parents[2]


def copy_of_kernels(tmp_path: Path) -> Path:
    copy = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, copy)
    return copy


def test_a_compile_error_names_the_source_file_and_line(tmp_path, caplog):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        if in_ci():
            pytest.fail("no C++ compiler (required under CI=true): make cxx")
        pytest.skip("no C++ compiler: make cxx")
    # Given the kernel sources with a mistake on one line of the .cpp
    kernels = copy_of_kernels(tmp_path)
    source = kernels / "layer_kernels.cpp"
    lines = source.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith("extern \"C\""))
    lines[line - 1] += " not_a_declaration"
    source.write_text("\n".join(lines) + "\n")
    # When they are built
    with caplog.at_level(logging.WARNING):
        library = build_library(tmp_path / "cache", kernels)
    # Then nothing loads, and the warning points at that file and line
    assert library is None
    assert f"{source}:{line}:" in caplog.text


def test_any_change_to_a_source_file_gives_another_build(tmp_path):
    # Given a copy of the kernel sources and the key of their build
    kernels = copy_of_kernels(tmp_path)
    before = build_key("c++", kernel_sources(kernels))
    assert build_key("c++", kernel_sources(kernels)) == before
    # When any file changes (a header too, though no command line names it), Then so does the key
    for source in kernel_sources(kernels):
        text = source.read_text()
        source.write_text(text + "\n// changed\n")
        assert build_key("c++", kernel_sources(kernels)) != before, source.name
        source.write_text(text)
    assert build_key("c++", kernel_sources(kernels)) == before


def test_an_installed_package_carries_every_kernel_source():
    # Given the package data pyproject.toml declares for the model package
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["llmq.worker.engine.model"]
    # Then every source the build compiles or includes is shipped
    sources = kernel_sources()
    assert {p.suffix for p in sources} >= {".cpp", ".h"}
    for source in sources:
        relative = source.relative_to(KERNEL_DIR.parent).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative


def test_a_folder_without_sources_is_named_in_the_error(tmp_path):
    # When the sources are missing (a package installed without its data files)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        kernel_sources(tmp_path)


def test_workers_starting_together_compile_the_kernels_once(tmp_path, monkeypatch):
    # Given a compiler that takes a while and notes each run (a stand-in for a new CPU's
    # first build, minutes on an AVX2 host)
    runs = tmp_path / "runs"
    compiler = tmp_path / "slow-c++"
    compiler.write_text("#!/bin/sh\necho run >> " + str(runs) + "\nsleep 1\n"
                        "for last; do :; done\ntouch \"$last\"\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    # When four workers start together on it
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: build_library(tmp_path / "cache"), range(4)))
    # Then one compiled, and every one loads its library
    assert runs.read_text().count("run") == 1
    assert len(set(built)) == 1 and built[0] is not None and built[0].exists()
