// MathJax's settings, read when tex-svg.js (served with the site, tools/mkdocs_hooks.py) loads:
// it typesets only what pymdownx.arithmatex marked (class "arithmatex", \( \) inline, \[ \] display).
window.MathJax = {
  tex: {inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true},
  options: {ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex"},
  svg: {fontCache: "global"},
};
