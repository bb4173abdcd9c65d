"""The main job, `./verispec.sh generate` with no arguments, on the embedded Gemma 3 270M: it
copies out the built-in poem (text a newcomer can check against the prompt), stops at its end,
and ends with one line comparing it with plain decoding measured in the same run."""
import re
import subprocess
import sys

from verispec.cli import DEFAULT_PROMPT


def test_the_main_job_quotes_the_poem_and_compares_with_plain_decoding():
    code = "import sys; from verispec.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "generate", "--threads", "2"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    poem = DEFAULT_PROMPT.split("<poem>\n")[1].split("</poem>")[0].splitlines()
    lines = out.stdout.strip().splitlines()
    assert len(lines) >= 4 and lines[:4] == poem[:4], out.stdout  # a faithful copy, not a loop
    assert "</poem>" not in out.stdout and "finish=stop" in out.stderr
    compared = re.search(r"\[same prompt, plain decoding: ([\d.]+) tok/s; speculative ([\d.]+) tok/s "
                         r"\(([\d.]+)x\); identical: (\S+)\]", out.stderr)
    assert compared, out.stderr
    assert compared.group(4) == "yes" and float(compared.group(1)) > 0 and float(compared.group(2)) > 0
    assert "[speculation: armed: speculator 'ngram' drafted" in out.stderr
