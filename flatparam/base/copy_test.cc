#include "flatparam/base/copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace flatparam {
namespace {

// Every size around the 4-page block and every destination misalignment
// copies exactly, touching nothing outside the destination range.
TEST(CopyBytesTest, CopiesExactlyAtEveryAlignmentAndSize) {
  const size_t kMax = 3 * 16384 + 200;
  std::vector<uint8_t> src(kMax + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7);
  for (bool streaming : {false, true}) {
    for (size_t size :
         {size_t{0}, size_t{1}, size_t{63}, size_t{16383}, size_t{16384},
          size_t{16385}, size_t{32768 + 65}, kMax}) {
      for (size_t dst_off = 0; dst_off < 64; dst_off += 5) {
        for (size_t src_off : {size_t{0}, size_t{3}}) {
          std::vector<uint8_t> dst(kMax + 128, 0xee);
          CopyBytes(dst.data() + dst_off, src.data() + src_off, size,
                    streaming);
          for (size_t i = 0; i < dst.size(); ++i) {
            const bool inside = i >= dst_off && i < dst_off + size;
            const uint8_t want = inside ? src[i - dst_off + src_off] : 0xee;
            ASSERT_EQ(dst[i], want)
                << "streaming=" << streaming << " size=" << size
                << " dst_off=" << dst_off << " src_off=" << src_off
                << " i=" << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace flatparam
