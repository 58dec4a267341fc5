"""The Markdown of the API descriptions rendered for `/docs` (sgraf.serve.markdown)."""

from sgraf.serve.markdown import block, inline


def test_inline_code_bold_emphasis_and_links():
    assert inline("give `image_id` or `text`") == "give <code>image_id</code> or <code>text</code>"
    assert inline("**exactly** one, *not* both") == "<b>exactly</b> one, <em>not</em> both"
    assert inline("see [the schema](/openapi.json)") == 'see <a href="/openapi.json">the schema</a>'
    assert inline("2 * 3 * 4 and a_b*c") == "2 * 3 * 4 and a_b*c"         # no stray emphasis


def test_markup_is_escaped_never_injected():
    assert inline("<script>x</script> `<b>`") == "&lt;script&gt;x&lt;/script&gt; <code>&lt;b&gt;</code>"
    assert inline("[x](javascript:alert(1))") == "[x](javascript:alert(1))"  # only /path or http(s) links
    assert "<code>**not bold**</code>" in inline("`**not bold**`")


def test_paragraphs_and_lists():
    text = "Text -> the best images\n(`results`).\n\n- one `a`\n- two"
    assert block(text) == "<p>Text -&gt; the best images (<code>results</code>).</p>\n<ul><li>one <code>a</code></li><li>two</li></ul>"
    assert block("") == ""
