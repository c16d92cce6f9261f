"""espeak-ng as a separate process (the Debian package `espeak-ng`): text in, IPA phonemes out, one line a clause.

A process per utterance, not a library binding: espeak-ng's library keeps global state (one voice at a time), and a
crash or a hang in it takes one request's phonemes, not the server. Measured here: ~75 ms a call on 2 busy cores
(mostly loading its voice data), so one call covers a whole sentence, never a word.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

from omnivox.models.voice.voice_model import speakable

ESPEAK = "espeak-ng"
TIMEOUT_S = 10.0
# Where espeak-ng ends a clause (its output puts each on its own line); we put the mark back, as Piper does.
_CLAUSE_MARK = re.compile(r"[,;:.!?](?=\s|$)")


class EspeakMissing(RuntimeError):
    pass


def find_espeak() -> Path:
    """The espeak-ng binary on PATH; EspeakMissing (one line naming it) when it is not installed."""
    found = shutil.which(ESPEAK)
    if found is None:
        raise EspeakMissing(
            f"{ESPEAK} is not installed: Piper voices need it to phonemize text (Debian/Ubuntu: apt-get install "
            f"{ESPEAK})"
        )
    return Path(found)


class EspeakPhonemizer:
    def __init__(self, voice: str, binary: Path | None = None) -> None:
        self.binary = binary or find_espeak()
        self.voice = voice

    def phonemize(self, text: str) -> str:
        """IPA phonemes of `text` (NFD), its clause marks (, ; : . ! ?) kept between clauses; "" when espeak says
        nothing. RuntimeError (one line) when espeak-ng fails."""
        text = speakable(text).strip()
        if not text:
            return ""
        command = [str(self.binary), "-q", "-b", "1", "--ipa", "-v", self.voice]
        try:
            done = subprocess.run(command, input=text.encode(), capture_output=True, timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{ESPEAK} failed: {exc}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{ESPEAK} exited {done.returncode}: {done.stderr.decode(errors='replace')[-200:]}")
        lines = [line.strip() for line in done.stdout.decode(errors="replace").splitlines() if line.strip()]
        marks = _CLAUSE_MARK.findall(text)
        pieces = []
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if len(marks) in (len(lines), len(lines) - 1):  # espeak cut where the text has its marks
                mark = marks[i] if i < len(marks) else ""
            else:  # it also cut at an abbreviation ("Dr.", "e.g."): a comma between, the text's own at the end
                mark = (marks[-1] if marks and text.endswith(marks[-1]) else "") if last else ","
            pieces.append(line + mark)
        return unicodedata.normalize("NFD", " ".join(pieces))
