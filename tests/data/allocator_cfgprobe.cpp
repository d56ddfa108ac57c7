// Print what torch's own allocator-config parser (AcceleratorAllocatorConfig in the installed
// libc10.so, torch 2.13.0) makes of each PYTORCH_ALLOC_CONF string given on the command line:
//   OK|<env>|large=..|msplit=..|nsr=..|gc=..|es=..|div=<16 interval divisions>|d512=..
//   ERR|<env>|<exception text>
// Build against the installed wheel (no CUDA needed):
//   T=$(python -c 'import torch,os;print(os.path.dirname(torch.__file__))')
//   g++ -std=c++17 -I$T/include cfgprobe.cpp -L$T/lib -lc10 -Wl,-rpath,$T/lib -o cfgprobe
// Note: the C++ singleton keeps large_segment_size / expandable_segments between parses, so run
// one string per process when comparing (test_cfgprobe_against_torch_2_13_binary does).
#include <c10/core/AllocatorConfig.h>
#include <iostream>
using c10::CachingAllocator::AcceleratorAllocatorConfig;
int main(int argc, char** argv) {
  for (int a = 1; a < argc; ++a) {
    std::string env(argv[a]);
    try {
      AcceleratorAllocatorConfig::instance().parseArgs(env);
    } catch (const std::exception& e) {
      std::cout << "ERR|" << env << "|" << std::string(e.what()).substr(0, 400) << "\n";
      continue;
    }
    std::cout << "OK|" << env << "|large=" << AcceleratorAllocatorConfig::large_segment_size()
              << "|msplit=" << AcceleratorAllocatorConfig::max_split_size()
              << "|nsr=" << AcceleratorAllocatorConfig::max_non_split_rounding_size()
              << "|gc=" << AcceleratorAllocatorConfig::garbage_collection_threshold()
              << "|es=" << AcceleratorAllocatorConfig::use_expandable_segments() << "|div=";
    for (int i = 0; i < 16; ++i) {
      size_t sz = (size_t(1) << (20 + i));
      std::cout << AcceleratorAllocatorConfig::roundup_power2_divisions(sz) << (i < 15 ? "," : "");
    }
    std::cout << "|d512=" << AcceleratorAllocatorConfig::roundup_power2_divisions(512) << "\n";
  }
}
