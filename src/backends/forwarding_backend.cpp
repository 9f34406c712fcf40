// ForwardingBackend: the upstream must exist; everything else is inline forwarding.
#include "vkv/forwarding_backend.h"

#include "vkv/error.h"

namespace vkv {

ForwardingBackend::ForwardingBackend(std::shared_ptr<Backend> upstream) : upstream_(std::move(upstream)) {
  VKV_EXPECTS(upstream_ != nullptr, "a backend adaptor needs an upstream backend, got null");
}

}  // namespace vkv
