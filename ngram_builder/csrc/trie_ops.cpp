// Algorithms over whole tries: the empty trie, merge, prune and saving under a new fingerprint.
#include "trie.hpp"

#include <utility>

namespace ngb {

std::shared_ptr<TrieView> view_of(std::shared_ptr<Image> img) {
  return std::make_shared<TrieView>(std::move(img), Check::kTrusted, "in-memory trie");
}

std::shared_ptr<TrieView> empty_trie(int order, uint64_t vocab_size, const std::string& fingerprint) {
  CsrBuilder b(order, vocab_size, "");
  return view_of(b.finish("", fingerprint));
}

namespace {
void merge_rec(const TrieView& a, const TrieView& b, CsrBuilder& out, int k, uint64_t as, uint64_t ae, uint64_t bs,
               uint64_t be) {
  const int order = a.order();
  const int lvl = k + 1;
  while (as < ae || bs < be) {
    const int64_t ta = as < ae ? static_cast<int64_t>(a.token(lvl, as)) : INT64_MAX;
    const int64_t tb = bs < be ? static_cast<int64_t>(b.token(lvl, bs)) : INT64_MAX;
    uint64_t cas = 0, cae = 0, cbs = 0, cbe = 0;
    if (ta <= tb) {
      const uint64_t c = a.count(lvl, as);
      uint64_t cb = 0;
      if (ta == tb) cb = b.count(lvl, bs);
      if (cb > UINT64_MAX - c) throw FormatError("count overflow while merging");
      out.add_node(lvl, static_cast<uint32_t>(ta), c + cb);
      if (lvl < order) {
        a.children(lvl, as, cas, cae);
        if (ta == tb) b.children(lvl, bs, cbs, cbe);
      }
      ++as;
      if (ta == tb) ++bs;
    } else {
      out.add_node(lvl, static_cast<uint32_t>(tb), b.count(lvl, bs));
      if (lvl < order) b.children(lvl, bs, cbs, cbe);
      ++bs;
    }
    if (lvl < order) merge_rec(a, b, out, lvl, cas, cae, cbs, cbe);
  }
}

uint64_t prune_rec(const TrieView& t, CsrBuilder& out, int k, uint64_t i, uint64_t min_count) {
  uint64_t s, e;
  t.children(k, i, s, e);
  uint64_t reduced = 0;
  const int lvl = k + 1;
  for (uint64_t c = s; c < e; ++c) {
    const uint64_t cnt = t.count(lvl, c);
    if (cnt >= min_count) {
      out.add_node(lvl, t.token(lvl, c), cnt);
      if (lvl < t.order()) {
        const uint64_t r = prune_rec(t, out, lvl, c, min_count);
        out.adjust_current(lvl, -static_cast<int64_t>(r));
        reduced += r;
      }
    } else {
      reduced += cnt;
    }
  }
  return reduced;
}
}  // namespace

std::shared_ptr<Image> merge_tries(const TrieView& a, const TrieView& b, const std::string& out_path,
                                   const std::string& spill_dir, const std::string& fingerprint) {
  if (a.order() != b.order())
    throw std::invalid_argument("cannot merge tries of different order (" + std::to_string(a.order()) + " vs " +
                                std::to_string(b.order()) + ")");
  CsrBuilder out(a.order(), std::max(a.vocab_size(), b.vocab_size()), spill_dir);
  out.set_root_count(a.root_count() + b.root_count());
  merge_rec(a, b, out, 0, 0, a.level(1).n, 0, b.level(1).n);
  return out.finish(out_path, fingerprint);
}

std::shared_ptr<Image> prune_trie(const TrieView& t, uint64_t min_count, const std::string& out_path,
                                  const std::string& spill_dir) {
  CsrBuilder out(t.order(), t.vocab_size(), spill_dir);
  const uint64_t r = prune_rec(t, out, 0, 0, min_count);
  // The original leaves the pruned root at -r (its root starts from 0); we keep the consistent
  // value, which no query reads.
  out.set_root_count(t.root_count() >= r ? t.root_count() - r : 0);
  return out.finish(out_path, t.fingerprint());
}

void save_compact(const TrieView& t, const std::string& path, const std::string& fingerprint) {
  if (fingerprint.size() > kFingerprintMax)
    throw std::invalid_argument("tokenizer fingerprint longer than " + std::to_string(kFingerprintMax) + " bytes");
  const uint8_t* d = t.image()->data();
  const uint64_t size = t.image()->size();
  Header h;
  std::memcpy(&h, d, sizeof(h));
  std::memset(h.fingerprint, 0, sizeof(h.fingerprint));
  std::memcpy(h.fingerprint, fingerprint.data(), fingerprint.size());
  h.fingerprint_len = static_cast<uint32_t>(fingerprint.size());
  const Section* table = reinterpret_cast<const Section*>(d + kHeaderBytes);
  h.header_checksum = header_checksum(h, table, h.num_sections);
  TempPath out(path);
  FileWriter w(out.tmp);
  w.write(&h, sizeof(h));
  w.write(d + sizeof(h), size - sizeof(h));
  w.close();
  out.commit();
}

}  // namespace ngb
