// The original DART `.trie` format (see shared reference trie-format.md): read with full
// validation into the compact image, and written from it (parents before children, children in
// token order).
#include <algorithm>
#include <climits>

#include "trie.hpp"

namespace ngb {

namespace {
struct Edge {
  int32_t tok;
  uint64_t child;
};

void dfs_emit(int level, uint64_t node, const std::vector<uint64_t>& edge_start, const std::vector<Edge>& edges,
              const std::vector<int32_t>& freq, CsrBuilder& out) {
  for (uint64_t e = edge_start[node]; e < edge_start[node + 1]; ++e) {
    const Edge& ed = edges[e];
    out.add_node(level + 1, static_cast<uint32_t>(ed.tok), static_cast<uint64_t>(freq[ed.child]));
    dfs_emit(level + 1, ed.child, edge_start, edges, freq, out);
  }
}
}  // namespace

std::shared_ptr<Image> load_dart(const std::string& path, uint64_t vocab_size, const std::string& fingerprint) {
  FileReader r(path);
  const std::string what = "'" + path + "'";
  if (r.size() < 16) throw FormatError(what + " is too small to be a DART .trie file");
  const uint64_t order = r.get<uint64_t>();
  const uint64_t node_count = r.get<uint64_t>();
  if (order < 1 || order > static_cast<uint64_t>(kMaxOrder)) {
    std::string hint = order == 0x4D52474E54524144ull ? " (this is a compact trie: use NgramTrie.load)" : "";
    throw FormatError(what + ": bad order " + std::to_string(order) + " in DART .trie header" + hint);
  }
  if (node_count == 0 || node_count > (r.size() - 16) / 24)
    throw FormatError(what + ": node count " + std::to_string(node_count) + " inconsistent with the file size (" +
                      std::to_string(r.size()) + " bytes)");
  std::vector<int32_t> tok(node_count), freq(node_count);
  std::vector<uint64_t> parent(node_count), edge_start(node_count + 1, 0);
  std::vector<uint8_t> depth(node_count, 0);
  std::vector<Edge> edges;
  edges.reserve(node_count - 1);
  for (uint64_t i = 0; i < node_count; ++i) {
    tok[i] = r.get<int32_t>();
    parent[i] = r.get<uint64_t>();
    freq[i] = r.get<int32_t>();
    const uint64_t cc = r.get<uint64_t>();
    const std::string node = what + ": node " + std::to_string(i);
    if (i == 0) {
      if (parent[i] != 0) throw FormatError(node + " (root) has a parent");
    } else {
      if (parent[i] >= i) throw FormatError(node + " does not come after its parent");
      if (tok[i] < 0 || (vocab_size && static_cast<uint64_t>(tok[i]) >= vocab_size))
        throw FormatError(node + " has token id " + std::to_string(tok[i]) + " outside the vocabulary");
      if (freq[i] < 0) throw FormatError(node + " has a negative count");
      depth[i] = static_cast<uint8_t>(depth[parent[i]] + 1);
      if (depth[i] > order) throw FormatError(node + " is deeper than the order");
    }
    if (cc > node_count - 1 - edges.size()) throw FormatError(node + " has too many children");
    if (cc && depth[i] >= order) throw FormatError(node + " has children below the maximum depth");
    edge_start[i] = edges.size();
    for (uint64_t j = 0; j < cc; ++j) {
      Edge e;
      e.tok = r.get<int32_t>();
      e.child = r.get<uint64_t>();
      if (e.child <= i || e.child >= node_count) throw FormatError(node + " has a child index out of range");
      edges.push_back(e);
    }
  }
  edge_start[node_count] = edges.size();
  if (r.position() != r.size())
    throw FormatError(what + ": " + std::to_string(r.size() - r.position()) + " unexpected trailing bytes");
  if (edges.size() != node_count - 1) throw FormatError(what + ": some nodes are not reachable from the root");
  std::vector<uint8_t> seen(node_count, 0);
  for (uint64_t i = 0; i < node_count; ++i) {
    auto b = edges.begin() + static_cast<std::ptrdiff_t>(edge_start[i]);
    auto e = edges.begin() + static_cast<std::ptrdiff_t>(edge_start[i + 1]);
    for (auto it = b; it != e; ++it) {
      if (parent[it->child] != i || tok[it->child] != it->tok)
        throw FormatError(what + ": edge " + std::to_string(i) + " -> " + std::to_string(it->child) +
                          " disagrees with the child's own parent/token");
      if (seen[it->child]++) throw FormatError(what + ": node " + std::to_string(it->child) + " has two parents");
    }
    std::sort(b, e, [](const Edge& x, const Edge& y) { return x.tok < y.tok; });
    for (auto it = b; it != e && it + 1 != e; ++it)
      if (it->tok == (it + 1)->tok) throw FormatError(what + ": node " + std::to_string(i) + " has duplicate children");
  }
  CsrBuilder out(static_cast<int>(order), vocab_size, "");
  uint64_t root = static_cast<uint64_t>(freq[0]);
  if (freq[0] < 0) {
    // The original's reduce() leaves the pruned root at a negative value; no query reads it.
    root = 0;
    for (uint64_t e = edge_start[0]; e < edge_start[1]; ++e) root += static_cast<uint64_t>(freq[edges[e].child]);
  }
  out.set_root_count(root);
  dfs_emit(0, 0, edge_start, edges, freq, out);
  return out.finish("", fingerprint);
}

void save_dart(const TrieView& t, const std::string& path) {
  const int order = t.order();
  std::vector<uint64_t> base(order + 2, 0);
  base[0] = 0;
  base[1] = 1;
  for (int k = 1; k <= order; ++k) base[k + 1] = base[k] + t.level(k).n;
  const std::string tmp = path + ".partial-dart";
  try {
    FileWriter w(tmp);
    auto put_node = [&](int k, uint64_t i, uint64_t parent_global, uint64_t count) {
      const int32_t tk = k == 0 ? 0 : static_cast<int32_t>(t.token(k, i));
      if (count > static_cast<uint64_t>(INT32_MAX)) {
        if (k != 0)
          throw std::overflow_error("count " + std::to_string(count) + " on level " + std::to_string(k) +
                                    " does not fit the original format's int32");
        count = INT32_MAX;  // root count: never read by queries; saturate
      }
      const int32_t fr = static_cast<int32_t>(count);
      uint64_t s = 0, e = 0;
      if (k < order) t.children(k, i, s, e);
      const uint64_t cc = e - s;
      w.write(&tk, 4);
      w.write(&parent_global, 8);
      w.write(&fr, 4);
      w.write(&cc, 8);
      for (uint64_t c = s; c < e; ++c) {
        const int32_t ct = static_cast<int32_t>(t.token(k + 1, c));
        const uint64_t ci = base[k + 1] + c;
        w.write(&ct, 4);
        w.write(&ci, 8);
      }
    };
    const uint64_t order64 = static_cast<uint64_t>(order), total = t.num_nodes();
    w.write(&order64, 8);
    w.write(&total, 8);
    put_node(0, 0, 0, t.root_count());
    for (int k = 1; k <= order; ++k) {
      // Level k in index order, walking parents to know each node's parent index.
      const uint64_t parents = k == 1 ? 1 : t.level(k - 1).n;
      for (uint64_t p = 0; p < parents; ++p) {
        uint64_t s, e;
        t.children(k - 1, p, s, e);
        const uint64_t pg = k == 1 ? 0 : base[k - 1] + p;
        for (uint64_t c = s; c < e; ++c) put_node(k, c, pg, t.count(k, c));
      }
    }
    w.close();
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw IoError("cannot move '" + tmp + "' to '" + path + "'");
  }
}

}  // namespace ngb
