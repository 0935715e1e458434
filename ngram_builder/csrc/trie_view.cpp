// TrieView: an image checked and indexed for queries (the dense level-1 index, the unigram table, the
// candidate index), and its node accessors (find_child, find_path, token, count, children).
#include "trie_query.hpp"

#include <utility>

namespace ngb {

TrieView::TrieView(std::shared_ptr<Image> image, Check check, const std::string& what)
    : image_(std::move(image)) {
  const uint8_t* d = image_->data();
  const uint64_t size = image_->size();
  if (size < kHeaderBytes)
    throw FormatError(what + ": too small to be a compact n-gram trie (" + std::to_string(size) + " bytes)");
  std::memcpy(&hdr_, d, sizeof(Header));
  if (std::memcmp(hdr_.magic, kMagic, 8) != 0) {
    uint64_t first;
    std::memcpy(&first, d, 8);
    std::string hint = (first >= 1 && first <= 64) ? " (it looks like an original DART .trie: use load_dart)" : "";
    throw FormatError(what + ": not a compact n-gram trie (bad magic)" + hint);
  }
  if (hdr_.version != kVersion)
    throw FormatError(what + ": unsupported format version " + std::to_string(hdr_.version) + " (this build reads " +
                      std::to_string(kVersion) + ")");
  if (hdr_.header_bytes != kHeaderBytes) throw FormatError(what + ": bad header size");
  if (hdr_.order < 1 || hdr_.order > static_cast<uint32_t>(kMaxOrder))
    throw FormatError(what + ": bad order " + std::to_string(hdr_.order));
  if (hdr_.vocab_size > (1ull << 31)) throw FormatError(what + ": bad vocabulary size");
  const uint32_t want_tb = hdr_.vocab_size <= 65536 ? 2 : 4;
  if (hdr_.token_bytes != want_tb) throw FormatError(what + ": bad token width");
  if (hdr_.fingerprint_len > kFingerprintMax) throw FormatError(what + ": bad fingerprint length");
  const int order = static_cast<int>(hdr_.order);
  if (hdr_.num_sections != expected_sections(order)) throw FormatError(what + ": bad section count");
  if (hdr_.file_size != size)
    throw FormatError(what + ": size mismatch (header says " + std::to_string(hdr_.file_size) + " bytes, file has " +
                      std::to_string(size) + "; truncated or extended)");
  const uint64_t table_end = kHeaderBytes + static_cast<uint64_t>(hdr_.num_sections) * sizeof(Section);
  if (table_end > size) throw FormatError(what + ": truncated section table");
  std::vector<Section> table(hdr_.num_sections);
  std::memcpy(table.data(), d + kHeaderBytes, table.size() * sizeof(Section));
  if (header_checksum(hdr_, table.data(), table.size()) != hdr_.header_checksum)
    throw CorruptError("header checksum mismatch, at offset 0");

  // Re-derive the layout from the per-level shape and require the table to match it exactly.
  std::vector<LevelShape> shape(order + 1);
  size_t si = 0;
  for (int k = 1; k <= order; ++k) {
    const Section& t = table[si];
    const Section& c = table[si + 1];
    const Section& e = table[si + 2];
    shape[k].n = t.count;
    shape[k].count_bytes = c.elem_bytes;
    shape[k].n_esc = e.count;
    if (c.elem_bytes != 1 && c.elem_bytes != 2 && c.elem_bytes != 4 && c.elem_bytes != 8)
      throw FormatError(what + ": bad count width");
    si += 4;
    if (k < order) {
      shape[k].child_bytes = table[si].elem_bytes;
      if (shape[k].child_bytes != 4 && shape[k].child_bytes != 8) throw FormatError(what + ": bad offset width");
      ++si;
    }
  }
  if (order >= 2) shape[2].hash_slots = table[si].count;
  std::vector<Section> expect;
  uint64_t expect_size = compute_layout(order, hdr_.token_bytes, shape, expect);
  if (expect_size != size || expect.size() != table.size())
    throw FormatError(what + ": section table inconsistent with file size");
  for (size_t i = 0; i < table.size(); ++i) {
    const Section& a = table[i];
    const Section& b = expect[i];
    const bool reserved_ok = a.kind == kHash ? a.reserved <= a.count : a.reserved == 0;
    if (a.level != b.level || a.kind != b.kind || a.elem_bytes != b.elem_bytes || a.offset != b.offset ||
        a.count != b.count || !reserved_ok)
      throw FormatError(what + ": section table entry " + std::to_string(i) + " is inconsistent");
  }
  uint64_t nodes = 1;
  for (int k = 1; k <= order; ++k) {
    if (shape[k].n > size) throw FormatError(what + ": bad level size");
    nodes += shape[k].n;
  }
  if (nodes != hdr_.num_nodes) throw FormatError(what + ": node count mismatch");

  lv_.assign(order + 2, LevelView{});
  si = 0;
  for (int k = 1; k <= order; ++k) {
    LevelView& L = lv_[k];
    L.n = shape[k].n;
    L.tokens = d + table[si].offset;
    L.counts = d + table[si + 1].offset;
    L.count_bytes = shape[k].count_bytes;
    L.esc_idx = reinterpret_cast<const uint64_t*>(d + table[si + 2].offset);
    L.esc_val = reinterpret_cast<const uint64_t*>(d + table[si + 3].offset);
    L.n_esc = shape[k].n_esc;
    si += 4;
    if (k < order) {
      L.child = d + table[si].offset;
      L.child_bytes = shape[k].child_bytes;
      ++si;
    }
  }
  if (order >= 2) {
    const Section& h = table[si];
    hash_slots_ = h.count;
    hash_max_probe_ = h.reserved;
    hash_ = d + h.offset;
    if (hash_slots_ && (hash_slots_ < lv_[2].n || lv_[2].n >= kHashEmpty))
      throw FormatError(what + ": hash table too small for level 2");
  }
  // Cheap structural checks: child arrays span exactly the next level; level 1 sorted, in vocab.
  for (int k = 1; k < order; ++k) {
    if (child_at(lv_[k], 0) != 0 || child_at(lv_[k], lv_[k].n) != lv_[k + 1].n)
      throw CorruptError("child offsets of level " + std::to_string(k) + " do not span level " +
                         std::to_string(k + 1) + ", at level-" + std::to_string(k) + " node 0");
  }
  if (lv_[1].n > hdr_.vocab_size) throw FormatError(what + ": more unigrams than vocabulary entries");
  const bool dense = hdr_.vocab_size <= (1ull << 27);
  if (dense) dense1_.assign(hdr_.vocab_size, 0);
  int64_t prev = -1;
  for (uint64_t i = 0; i < lv_[1].n; ++i) {
    uint32_t t = token_at(lv_[1], i);
    if (static_cast<int64_t>(t) <= prev || t >= hdr_.vocab_size)
      throw CorruptError(std::string(t >= hdr_.vocab_size ? "token id " + std::to_string(t) + " outside the vocabulary of " +
                                                                std::to_string(hdr_.vocab_size)
                                                          : "level-1 tokens out of order") +
                         ", at level-1 node " + std::to_string(i));
    prev = t;
    if (dense) dense1_[t] = static_cast<uint32_t>(i + 1);
  }
  if (check != Check::kTrusted) check_structure();
  if (dense && order >= 2 && hash_slots_) {
    uni_.assign(hdr_.vocab_size, Unigram{});
    for (uint64_t i = 0; i < lv_[1].n; ++i) {
      Unigram& u = uni_[token_at(lv_[1], i)];
      u.idx1 = static_cast<uint32_t>(i + 1);
      const uint64_t s = child_at(lv_[1], i), e = child_at(lv_[1], i + 1);
      bool ok = true;
      const uint64_t c = count_checked(1, i, ok);
      if (!ok || s > e || e > lv_[2].n) {
        u.s = 1;  // corrupt: a query touching it reports it
        continue;
      }
      u.s = static_cast<uint32_t>(s);  // < 2^32: the hash's node indices are u32
      u.e = static_cast<uint32_t>(e);
      u.inv = c ? 1.0f / static_cast<float>(c) : 0.0f;
    }
    dense1_.clear();
    dense1_.shrink_to_fit();
  }
  if (check == Check::kFull) full_verify();
}

void TrieView::full_verify() const {
  const uint8_t* d = image_->data();
  const uint64_t start = align_up(kHeaderBytes + static_cast<uint64_t>(hdr_.num_sections) * sizeof(Section));
  Hasher h;
  h.update(d + start, image_->size() - start);
  if (h.digest() != hdr_.payload_checksum)
    throw CorruptError("payload checksum mismatch, somewhere in bytes " + std::to_string(start) + ".." +
                       std::to_string(image_->size()));
  if (!hash_slots_) return;
  // Tokens, counts, escapes and child offsets were checked by check_structure; here the hash.
  uint64_t used = 0;
  for (uint64_t i = 0; i < hash_slots_; ++i) {
    uint32_t j;
    std::memcpy(&j, hash_ + i * 4, 4);
    if (j == kHashEmpty) continue;
    if (j >= lv_[2].n) throw CorruptError("level-2 hash slot out of range, at hash slot " + std::to_string(i));
    ++used;
  }
  if (used != lv_[2].n)
    throw CorruptError("level-2 hash indexes " + std::to_string(used) + " of " + std::to_string(lv_[2].n) +
                       " nodes, at the level-2 hash");
  for (uint64_t p = 0; p < lv_[1].n; ++p) {
    const uint64_t s = child_at(lv_[1], p), e = child_at(lv_[1], p + 1);
    for (uint64_t j = s; j < e; ++j)
      if (hash_find(token_at(lv_[1], p), token_at(lv_[2], j), s, e) != j)
        throw CorruptError("level-2 hash misses a node, at level-2 node " + std::to_string(j));
  }
}

uint64_t TrieView::ram_bytes() const {
  return image_->size() + dense1_.size() * sizeof(uint32_t) + uni_.size() * sizeof(Unigram) +
         cand_table_.size() * sizeof(uint64_t) + cand_slots_.size();
}

uint64_t TrieView::count_checked(int k, uint64_t i, bool& ok) const {
  const LevelView& L = lv_[k];
  uint64_t v = read_uint(L.counts, L.count_bytes, i);
  if (L.count_bytes == 8 || v != sentinel(L.count_bytes)) return v;
  const uint64_t lo = first_escape(L, i);
  uint64_t x = 0;
  if (lo < L.n_esc) std::memcpy(&x, L.esc_idx + lo, 8);
  if (lo >= L.n_esc || x != i) {
    ok = false;
    return 0;
  }
  std::memcpy(&x, L.esc_val + lo, 8);
  return x;
}

uint64_t TrieView::hash_probe(uint64_t i, uint32_t tok, uint64_t s, uint64_t e) const {
  return hdr_.token_bytes == 2
             ? probe_slots<uint16_t>(hash_, hash_slots_, hash_max_probe_, i, tok, s, e, lv_[2].tokens)
             : probe_slots<uint32_t>(hash_, hash_slots_, hash_max_probe_, i, tok, s, e, lv_[2].tokens);
}

bool TrieView::find_child(int k, uint64_t i, int64_t tok, uint64_t& out, bool& ok) const {
  if (tok < 0 || static_cast<uint64_t>(tok) >= hdr_.vocab_size || k >= static_cast<int>(hdr_.order)) return false;
  const uint32_t t = static_cast<uint32_t>(tok);
  uint64_t s, e;
  if (k == 0) {
    if (!uni_.empty() || !dense1_.empty()) {
      uint32_t idx = uni_.empty() ? dense1_[t] : uni_[t].idx1;
      if (!idx) return false;
      out = idx - 1;
      return true;
    }
    s = 0;
    e = lv_[1].n;
  } else {
    const LevelView& L = lv_[k];
    s = child_at(L, i);
    e = child_at(L, i + 1);
    if (s > e || e > lv_[k + 1].n) {
      ok = false;
      return false;
    }
    if (k == 1 && hash_slots_ && e - s >= kHashMinRange) {
      const uint64_t j = hash_find(token_at(lv_[1], i), static_cast<uint32_t>(tok), s, e);
      if (j == UINT64_MAX) return false;
      out = j;
      return true;
    }
  }
  if (hdr_.token_bytes == 2) {
    if (t > 0xFFFF) return false;
    return search_tokens<uint16_t>(lv_[k + 1].tokens, s, e, t, out);
  }
  return search_tokens<uint32_t>(lv_[k + 1].tokens, s, e, t, out);
}

bool TrieView::find_path(const int32_t* ctx, size_t len, uint64_t& node, bool& ok) const {
  uint64_t cur = 0;
  for (size_t j = 0; j < len; ++j) {
    uint64_t nxt;
    if (!find_child(static_cast<int>(j), cur, ctx[j], nxt, ok)) return false;
    cur = nxt;
  }
  node = cur;
  return true;
}

template <class TT>
void TrieView::build_candidate_index_t() {
  // Tables of 2^bits >= 2 * children slots (at most half full: short probes) for the contexts
  // whose candidates would go through the hash; runs of 2^(8 * sizeof(TT)) - 1 or more children
  // (all of a 2-byte vocabulary) cannot be described by a TT position and stay with the hash.
  std::vector<uint64_t> table(uni_.size(), 0);
  uint64_t total = 0;
  for (size_t tok = 0; tok < uni_.size(); ++tok) {
    const Unigram& u = uni_[tok];
    if (u.s > u.e || u.e - u.s < kHashedRunMin<TT> || u.e - u.s >= kCandEmpty<TT>) continue;
    uint64_t bits = 1;
    while ((1ull << bits) < 2 * (u.e - u.s)) ++bits;
    table[tok] = total << 8 | bits;
    total += 1ull << bits;
  }
  if (total == 0) return;
  HugeBuffer slots(total * 2 * sizeof(TT));
  uint8_t* base = slots.data();
  const TT empty[2] = {0, kCandEmpty<TT>};
  for (uint64_t i = 0; i < total; ++i) std::memcpy(base + i * sizeof(empty), empty, sizeof(empty));
  for (size_t tok = 0; tok < uni_.size(); ++tok) {
    if (!table[tok]) continue;
    const Unigram& u = uni_[tok];
    const uint64_t first = table[tok] >> 8, bits = table[tok] & 255, mask = (1ull << bits) - 1;
    for (uint64_t j = u.s; j < u.e; ++j) {
      const TT entry[2] = {static_cast<TT>(token_at(lv_[2], j)), static_cast<TT>(j - u.s)};
      uint64_t i = cand_slot(entry[0], bits);
      TT seen[2];
      for (;; i = (i + 1) & mask) {
        std::memcpy(seen, base + (first + i) * sizeof(seen), sizeof(seen));
        if (seen[1] == kCandEmpty<TT>) break;
      }
      std::memcpy(base + (first + i) * sizeof(entry), entry, sizeof(entry));
    }
  }
  slots.make_read_only();
  cand_table_ = std::move(table);
  cand_slots_ = std::move(slots);
}

void TrieView::build_candidate_index() {
  if (uni_.empty() || !cand_table_.empty()) return;
  if (hdr_.token_bytes == 2)
    build_candidate_index_t<uint16_t>();
  else
    build_candidate_index_t<uint32_t>();
}

uint32_t TrieView::token(int k, uint64_t i) const { return token_at(lv_[k], i); }

uint64_t TrieView::count(int k, uint64_t i) const {
  bool ok = true;
  uint64_t v = count_checked(k, i, ok);
  if (!ok) throw FormatError("corrupt trie: missing escape entry for a count on level " + std::to_string(k));
  return v;
}

void TrieView::children(int k, uint64_t i, uint64_t& begin, uint64_t& end) const {
  if (k == 0) {
    begin = 0;
    end = lv_[1].n;
    return;
  }
  if (k >= static_cast<int>(hdr_.order)) {
    begin = end = 0;
    return;
  }
  begin = child_at(lv_[k], i);
  end = child_at(lv_[k], i + 1);
  if (begin > end || end > lv_[k + 1].n)
    throw FormatError("corrupt trie: child offsets out of range on level " + std::to_string(k));
}

}  // namespace ngb
