// The FileSystem contract (testing/file_system_conformance.h) on the POSIX
// file system and on FaultInjectionFileSystem, which the crash tests of
// every checkpoint writer stand on.
#include "testing/file_system_conformance.h"

#include <gtest/gtest.h>

namespace flatparam {
namespace checkpoint {
namespace {

INSTANTIATE_TEST_SUITE_P(
    FileSystems, FileSystemConformanceTest,
    ::testing::Values(FileSystemUnderTest{"Posix", MakePosixFixture},
                      FileSystemUnderTest{"FaultInjection",
                                          MakeFaultInjectionFixture}),
    FileSystemUnderTestName);

}  // namespace
}  // namespace checkpoint
}  // namespace flatparam
