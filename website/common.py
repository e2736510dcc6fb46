"""Sphinx settings shared by the Japanese and the English site.

Each language is its own Sphinx project (website/ja, website/en), so that each
gets its own search index in its own language: Sphinx splits Japanese words for
search only in a project whose `language` is "ja". Both render the lessons as nbval
executed them (build/executed/<lang>, copied into their lessons/ folder by
labkit_site): the site shows the run that was tested, and runs nothing itself.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def settings(lang: str) -> dict:
    """The conf.py values of the `lang` site."""
    return {
        "project": "labkit",
        "author": "labkit",
        # as the README's License section says
        "copyright": {"ja": "labkit (コードは MIT、レッスンの文章は CC BY 4.0)",
                      "en": "labkit (code: MIT; the lessons' prose: CC BY 4.0)"}[lang],
        "language": lang,
        "extensions": ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon",
                       "labkit_site"],
        "html_theme": "sphinx_book_theme",
        "html_title": {"ja": "labkit: PyTorch のデータ並列を学ぶ",
                       "en": "labkit: learning PyTorch data parallelism"}[lang],
        "html_theme_options": {
            # Nothing fetched at build time or when a page opens: no repository
            # buttons, no launch buttons (the course runs locally: tools/course.py lab).
            "use_download_button": True,
            "use_fullscreen_button": False,
            "show_toc_level": 2,
            # One search box, the sidebar's: the theme's header would add a second
            # (pydata-sphinx-theme's navbar_persistent, which an empty value in
            # sphinx-book-theme's theme.conf does not clear). tests/test_site.py
            # counts them.
            "navbar_persistent": [],
            # the same page in the other language, beside the theme's buttons
            "article_header_end": ["labkit-twin.html", "article-header-buttons.html"],
        },
        "templates_path": [str(ROOT / "website" / "_templates")],
        "html_static_path": [str(ROOT / "website" / "_static")],
        "html_css_files": ["labkit.css"],
        "html_last_updated_fmt": None,
        # the theme's download button offers each page's source: a lesson's notebook
        "html_copy_source": True,
        "exclude_patterns": ["lessons/.ipynb_checkpoints"],
        "myst_enable_extensions": ["colon_fence"],
        "myst_heading_anchors": 3,
        # The lessons come executed (tools/executed.py): never run them here.
        "nb_execution_mode": "off",
        "nb_merge_streams": True,
        # no widget library from a CDN: a widget's place holds a note instead
        # (labkit_site.widgets_as_notes)
        "nb_ipywidgets_js": {},
        "autodoc_member_order": "bysource",
        "autodoc_typehints": "description",
    }
