// Python bindings of the n-gram trie (ngram_builder._core).
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "C++ core of ngram_builder: n-gram trie build, prune, merge, formats and queries";
}
