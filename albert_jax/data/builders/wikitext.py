"""MediaWiki markup -> clean prose, the way BERT/ALBERT prepared Wikipedia.

BERT (§3.1, followed by ALBERT §4.1): "For Wikipedia we extract only the text passages and
ignore lists, tables, and headers." `clean_wikitext` therefore keeps the running text of an
article and drops everything else:

- templates (`{{...}}`, infoboxes, citation templates), template arguments (`{{{x}}}`), except
  a few inline templates whose output is part of a sentence (`{{convert|5|km}}` -> "5 km",
  `{{lang|fr|texte}}` -> "texte", `{{nowrap|...}}`, `{{as of|2010}}`, ...);
- tables (`{| ... |}`), `<ref>` footnotes, `<gallery>`, `<math>` and other non-prose tags;
- links to files, images, categories and other-language wikis; other links keep their label;
- external links keep their label (bare URLs are dropped);
- headings, list items, and whole trailing sections such as "References" or "External links";
- bold/italic quotes, HTML tags (their content is kept), comments, magic words like __TOC__;
- HTML entities are decoded (`&nbsp;` -> a space, `&amp;` -> `&`).

Paragraphs are separated by one "\\n" (the convention of every document source here). Lines of
one wikitext paragraph are joined with a space, as MediaWiki renders them.

`<ref>` footnotes and comments are cut with a regular expression first (they are never prose
and hold a third of an article's markup); the rest is parsed by mwparserfromhell (a complete
wikitext tokenizer with a C speed-up). The walk over its node tree is ours and visits every
node once, so cleaning is linear in the page size.
"""

from __future__ import annotations

import re

import mwparserfromhell
from mwparserfromhell import nodes
from mwparserfromhell.wikicode import Wikicode

# Tags whose content is not prose (footnotes, formulas, galleries, code, layout tables...).
_DROPPED_TAGS = frozenset(
    {
        "ref",
        "references",
        "gallery",
        "math",
        "chem",
        "ce",
        "score",
        "timeline",
        "imagemap",
        "graph",
        "inputbox",
        "categorytree",
        "templatedata",
        "syntaxhighlight",
        "source",
        "pre",
        "code",
        "nowiki",
        "table",
        "mapframe",
        "maplink",
        "hiero",
        "noinclude",
        "includeonly",
        "onlyinclude",
        "section",
        "indicator",
        "templatestyles",
        "abbr-title",
        "sup-ref",
    }
)
# Link namespaces (and their English aliases) that are media, categories or metadata, not prose.
_DROPPED_LINK_PREFIXES = frozenset(
    {
        "file",
        "image",
        "media",
        "category",
        "template",
        "wikipedia",
        "wp",
        "help",
        "portal",
        "special",
        "user",
        "talk",
        "draft",
        "module",
        "mediawiki",
        "book",
        "timedtext",
    }
)
# Sections at the end of an article that hold references and link lists, not prose.
_DROPPED_SECTIONS = frozenset(
    {
        "references",
        "external links",
        "see also",
        "notes",
        "further reading",
        "bibliography",
        "sources",
        "citations",
        "footnotes",
        "notes and references",
        "references and notes",
        "works cited",
        "gallery",
        "external sources",
        "selected bibliography",
        "publications",
        "discography",
        "filmography",
    }
)
# Inline templates that stand for words of the sentence around them: name -> the positional
# parameter (1-based) that holds the shown text. Everything else in `{{...}}` is dropped.
_TEXT_PARAM_TEMPLATES = {
    "lang": 2,
    "transl": -1,  # -1: the last positional parameter
    "translit": -1,
    "nowrap": 1,
    "nobr": 1,
    "small": 1,
    "smaller": 1,
    "big": 1,
    "larger": 1,
    "resize": -1,
    "nihongo": 1,
    "vanchor": 1,
    "visible anchor": 1,
    "abbr": 1,
    "sic": -1,
    "ill": 1,
    "interlanguage link": 1,
    "nts": 1,
    "val": 1,
    "keypress": 1,
    "linktext": 1,
    "em": 1,
    "strong": 1,
    "var": 1,
    "mvar": 1,
    "not a typo": 1,
    "proper name": 1,
}
_SYMBOL_TEMPLATES = {
    "nbsp": " ",
    "'s": "'s",
    "'": "'",
    "!": "|",
    "·": " · ",
    "ndash": "–",
    "mdash": "—",
    "snd": " – ",
    "spaced ndash": " – ",
    "sndash": " – ",
    "spnd": " – ",
}
# Words that join two quantities of a range in {{convert|5|to|10|km}}.
_CONVERT_RANGE_WORDS = frozenset({"to", "-", "–", "and", "or", "by", "x", "×", "+/-", "±", "to(-)"})
# Markers the renderer leaves at the start of a line; `_paragraphs` acts on them. Private-use
# code points cannot occur in the rendered text (they are removed from it first).
_HEADING = "\ue000"
_LIST_ITEM = "\ue001"
_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")

_REFS_AND_COMMENTS = re.compile(
    r"<ref\b[^>]*?/>|<ref\b[^>]*>.*?</ref\s*>|<!--.*?-->", re.DOTALL | re.IGNORECASE
)
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_LEFTOVER_QUOTES = re.compile(r"'{2,}")
_SPACES = re.compile(r"[ \t\u00a0\u2009\u200b]+")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?)\]])")
_SPACE_AFTER_OPEN = re.compile(r"([(\[]) +")
# "()" / "(, )" / "( ; )" left where a template (a pronunciation, a date) was removed.
_EMPTY_BRACKETS = re.compile(r"\s*[(\[][\s,;:]*[)\]]")
_LEADING_PUNCT_IN_BRACKETS = re.compile(r"([(\[])[\s,;:]+")
_TRAILING_PUNCT_IN_BRACKETS = re.compile(r"[\s,;:]+([)\]])")
_REPEATED_PUNCT = re.compile(r"([,;])(\s*[,;])+")


def _is_language_code(prefix: str) -> bool:
    """Interlanguage links look like [[de:Anarchismus]] or [[zh-yue:...]]."""
    return re.fullmatch(r"[a-z]{2,3}(-[a-z]{2,8})*", prefix) is not None


def _render_link(link: nodes.Wikilink) -> str:
    target = " ".join(_render(link.title).split())  # titles may hold entities: [[35&nbsp;mm]]
    # A leading ":" turns a category/file link into a plain link that is shown as text.
    shown_as_text = target.startswith(":")
    target = target.lstrip(":").strip()
    if ":" in target and not shown_as_text:
        prefix = target.split(":", 1)[0].strip().lower()
        if prefix in _DROPPED_LINK_PREFIXES or _is_language_code(prefix):
            return ""
    if link.text is not None:
        return _render(link.text)
    # [[Foo#Bar]] shows "Foo#Bar"; the anchor is navigation, not text.
    return target.split("#", 1)[0] if not target.startswith("#") else target[1:]


def _positional(template: nodes.Template) -> list[str]:
    return [_render(p.value).strip() for p in template.params if not p.showkey]


def _render_template(template: nodes.Template) -> str:
    """The shown text of a handful of inline templates; "" for all others (infoboxes, cites)."""
    name = " ".join(str(template.name).replace("_", " ").split()).lower()
    if name in _SYMBOL_TEMPLATES:
        return _SYMBOL_TEMPLATES[name]
    if name in ("convert", "cvt"):
        # {{convert|5|km|mi}} -> "5 km"; {{convert|5|to|10|km}} -> "5 to 10 km".
        args = _positional(template)
        if not args:
            return ""
        shown, i = [args[0]], 1
        while i + 1 < len(args) and args[i] in _CONVERT_RANGE_WORDS:
            shown += [args[i], args[i + 1]]
            i += 2
        if i < len(args):
            shown.append(args[i])
        return " ".join(shown)
    if name == "as of":
        args = _positional(template)
        lowercase = template.has("lc") and str(template.get("lc").value).strip() in ("y", "yes")
        return f"{'as' if lowercase else 'As'} of {args[0]}" if args else ""
    if name == "frac":
        args = _positional(template)
        if len(args) == 1:
            return f"1/{args[0]}"
        if len(args) == 2:
            return f"{args[0]}/{args[1]}"
        return f"{args[0]} {args[1]}/{args[2]}" if len(args) >= 3 else ""
    index = 1 if name.startswith("lang-") else _TEXT_PARAM_TEMPLATES.get(name)
    if index is None:
        return ""
    args = _positional(template)
    if not args or index > len(args):
        return ""
    return args[index - 1] if index > 0 else args[-1]


def _render_tag(tag: nodes.Tag) -> str:
    name = str(tag.tag).strip().lower()
    markup = tag.wiki_markup
    if markup in ("*", "#", ";"):  # list items and definition terms: BERT drops lists
        return _LIST_ITEM
    if markup == ":":  # indentation only; the indented text is kept
        return ""
    if markup == "----":  # horizontal rule
        return "\n"
    if name in _DROPPED_TAGS or markup == "{|":
        return ""
    if name == "br":
        return " "
    if tag.self_closing or tag.contents is None:
        return ""
    return _render(tag.contents)


def _render(code: Wikicode) -> str:
    """Renders one node list to text with list/heading markers; linear in the number of nodes."""
    parts: list[str] = []
    for node in code.nodes:
        if isinstance(node, nodes.Text):
            parts.append(_PRIVATE_USE.sub("", node.value))
        elif isinstance(node, nodes.Wikilink):
            parts.append(_render_link(node))
        elif isinstance(node, nodes.ExternalLink):
            # [http://x label] shows "label"; a bare or unlabelled URL is not prose.
            parts.append(_render(node.title) if node.title is not None else "")
        elif isinstance(node, nodes.Tag):
            parts.append(_render_tag(node))
        elif isinstance(node, nodes.HTMLEntity):
            parts.append(node.normalize())
        elif isinstance(node, nodes.Heading):
            title = " ".join(_render(node.title).split())
            parts.append(f"\n{_HEADING}{node.level} {title}\n")
        elif isinstance(node, nodes.Template):
            parts.append(_render_template(node))
        # Template arguments ({{{x}}}) and comments produce no prose.
    return "".join(parts)


def _tidy(line: str) -> str:
    line = _MAGIC_WORD.sub("", line)
    line = _LEFTOVER_QUOTES.sub("", line)
    line = _SPACES.sub(" ", line)
    line = _EMPTY_BRACKETS.sub("", line)
    line = _LEADING_PUNCT_IN_BRACKETS.sub(r"\1", line)
    line = _TRAILING_PUNCT_IN_BRACKETS.sub(r"\1", line)
    line = _REPEATED_PUNCT.sub(r"\1", line)
    line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
    line = _SPACE_AFTER_OPEN.sub(r"\1", line)
    return line.strip()


def _is_markup_debris(line: str) -> bool:
    """Lines left by markup the parser could not match (unclosed tables or templates)."""
    return line.startswith(("{|", "|", "!", "{{", "}}", "<", "[[")) or not any(
        c.isalpha() for c in line
    )


def _paragraphs(rendered: str) -> list[str]:
    """Splits rendered text into paragraphs; drops headings, lists and reference sections."""
    paragraphs: list[str] = []
    current: list[str] = []
    dropped_section_level = 0  # > 0 while inside a section such as "References"

    def flush() -> None:
        if current:
            paragraphs.append(_tidy(" ".join(current)))  # tidy again across line joins
            current.clear()

    for raw_line in rendered.split("\n"):
        if raw_line.startswith(_HEADING):
            flush()
            level_str, _, title = raw_line[1:].partition(" ")
            level = int(level_str)
            if dropped_section_level and level > dropped_section_level:
                continue  # a subsection of a dropped section
            dropped_section_level = level if title.strip().lower() in _DROPPED_SECTIONS else 0
            continue
        if dropped_section_level:
            continue
        if raw_line.lstrip().startswith(_LIST_ITEM):
            flush()
            continue
        line = _tidy(raw_line)
        if not line:
            flush()  # a blank line ends a paragraph
            continue
        if _is_markup_debris(line):
            continue
        current.append(line)
    flush()
    return paragraphs


def clean_wikitext(markup: str) -> str:
    """Returns the prose of one article's wikitext: paragraphs joined by "\\n" ("" if none)."""
    # Footnotes and comments are never prose and hold about a third of an article's markup
    # (citation templates); cutting them before parsing halves the parse time.
    markup = _REFS_AND_COMMENTS.sub("", markup)
    code = mwparserfromhell.parse(markup, skip_style_tags=False)
    return "\n".join(_paragraphs(_render(code)))


def clean_page(page: tuple[str, str, str]) -> tuple[str, str, str]:
    """(key, title, wikitext) -> (key, title, clean text); a picklable unit of parallel work."""
    key, title, markup = page
    return key, title, clean_wikitext(markup)
