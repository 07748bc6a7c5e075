"""Every symbol the page shows is one the common fonts draw: the DejaVu fonts (Debian's chromium, most Linux
desktops) have no emoji, so an emoji such as the no-entry sign rendered as an empty box at the start of error
messages (issue 24). Symbols must come from this list, each checked with `fc-list :charset=<hex>` against
DejaVu Sans / Sans Mono; a new one is added here once checked, or drawn in CSS (assets/style.css)."""
import pathlib
import unicodedata

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRAWN = set("→↪↻⇪≈−■▶◀★⚠✎✓✕✖✗")


def test_every_symbol_in_the_ui_has_a_glyph_in_the_common_fonts():
    files = [*ROOT.glob("locales/**/*.yaml"), *ROOT.glob("webui/**/*.py"), ROOT / "assets" / "style.css"]
    found = {}
    for path in files:
        for ch in path.read_text(encoding="utf-8"):
            if unicodedata.category(ch) == "So" or (ord(ch) >= 0x2190 and unicodedata.category(ch) == "Sm"):
                found.setdefault(ch, path.relative_to(ROOT).as_posix())
    missing = {f"{ch} U+{ord(ch):04X} {unicodedata.name(ch, '?')}": where for ch, where in found.items()
               if ch not in DRAWN}
    assert not missing, missing
